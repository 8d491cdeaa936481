"""Every failure at the HTTP edge becomes OpenAI's `{"error": {message, type, param, code}}` with the right status."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgellm.errors import ContextOverflowError, EdgeLLMError, GrammarError, ModelNotFoundError, SchemaError
from edgellm.serve.protocol import LONE_SURROGATE

log = logging.getLogger("edgellm.serve")


class APIError(StarletteHTTPException):
    """An error with its HTTP status and OpenAI error fields (an HTTPException, so FastAPI passes it through
    even when raised while it reads the body)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class QueueFullError(APIError):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(429, "the server is busy: the request queue is full; retry later", type="rate_limit_error",
                         code="queue_full", headers={"Retry-After": str(retry_after_s)})


class RequestTimeoutError(APIError):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request did not finish within the server's timeout of {timeout_s:g} s",
                         type="timeout_error", code="timeout")


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to an APIError; unexpected ones become a 500 that reveals nothing of the request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, f"This model's maximum context length is {exc.context_window} tokens, but the prompt "
                             f"is {exc.prompt_tokens} tokens. Shorten the messages.",
                        param="messages", code="context_length_exceeded")
    if isinstance(exc, SchemaError):
        where = f" at {exc.pointer}" if exc.pointer and exc.pointer not in str(exc) else ""
        return APIError(400, f"{exc}{where}", param="response_format",
                        code="unsupported_schema_keyword" if exc.keyword else "invalid_schema")
    if isinstance(exc, GrammarError):
        return APIError(400, str(exc), param="response_format", code="invalid_grammar")
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, EdgeLLMError):
        return APIError(400, str(exc), code="invalid_request")
    log.error("internal error while serving a request: %s", type(exc).__name__)  # never the content
    return APIError(500, "internal server error", type="server_error", code="internal_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == LONE_SURROGATE:  # raised on the whole body: the error names its own place
        return APIError(400, str(first.get("msg")), param=str(first.get("ctx", {}).get("param")) or None,
                        code="invalid_value")
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not loc:
        return APIError(400, "the request body must be a JSON object (sent with Content-Type: application/json)",
                        code="invalid_json")
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request"))
    extra = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return APIError(400, f"invalid value for {param or 'the request body'}: {msg}{extra}", param=param,
                    code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    """400 (not 422) for validation errors, OpenAI bodies for HTTP errors, and a catch-all 500."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(APIError)
    async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _on_any(_: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()
