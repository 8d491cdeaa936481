"""Ollama's wire types (pydantic, Ollama's field names) and their conversion to the OpenAI requests the engine
path already serves (serve/engine_request.py), so both APIs share one set of checks, limits and structured output.

Nothing is ignored silently: a field or option edgellm cannot honour is refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from edgellm.serve.errors import APIError
from edgellm.serve.protocol import ChatCompletionRequest, CompletionRequest

# Ollama option → the OpenAI request field it sets.
OPTION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "num_predict": "max_tokens", "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
OPTIONS = tuple(OPTION_FIELDS) + ("num_ctx",)


class _Strict(BaseModel):
    """Unknown fields are refused (400 naming them), never dropped."""

    model_config = ConfigDict(extra="forbid")


class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Generating(_Strict):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    format: Union[Literal["", "json"], dict[str, Any], None] = None
    options: dict[str, Any] | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: Union[float, str, None] = None
    think: Union[bool, str, None] = None


class OllamaChatRequest(_Generating):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class OllamaGenerateRequest(_Generating):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class OllamaModelRequest(_Strict):
    """/api/show, /api/delete and /api/pull (`name` is the older spelling of `model`)."""

    model: str | None = None
    name: str | None = None
    stream: bool = True
    insecure: bool | None = None
    verbose: bool | None = None

    def model_name(self) -> str:
        given = self.model or self.name
        if not given:
            raise APIError(400, "model is required")
        return given


def _refuse(field: str, why: str = "") -> APIError:
    return APIError(400, f"{field} is not supported by edgellm{why}", param=field)


def _check_common(body: _Generating) -> None:
    if body.think not in (None, False):
        raise _refuse("think", " (no thinking models)")
    if getattr(body, "logprobs", None):
        raise _refuse("logprobs", " on the Ollama API (use /v1/chat/completions)")
    if getattr(body, "top_logprobs", None):
        raise _refuse("top_logprobs", " on the Ollama API (use /v1/chat/completions)")


def sampling_fields(options: dict[str, Any] | None) -> tuple[dict[str, Any], int | None]:
    """Ollama options → OpenAI request fields, and num_ctx; an unknown or unsupported option is a 400."""
    options = dict(options or {})
    unknown = sorted(k for k in options if k not in OPTIONS)
    if unknown:
        raise APIError(400, f"option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                       f"{'are' if len(unknown) > 1 else 'is'} not supported by edgellm (supported: "
                       f"{', '.join(OPTIONS)})", param="options")
    fields = {OPTION_FIELDS[k]: v for k, v in options.items() if k in OPTION_FIELDS and v is not None}
    predict = fields.get("max_tokens")
    if predict is not None and (not isinstance(predict, int) or isinstance(predict, bool) or predict < 1):
        raise APIError(400, f"options.num_predict must be a positive number of tokens, got {predict!r} (edgellm "
                       "has no unbounded generation: leave it out for the model's default)", param="options")
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and (not isinstance(num_ctx, int) or isinstance(num_ctx, bool) or num_ctx < 2):
        raise APIError(400, f"options.num_ctx must be an integer of at least 2, got {num_ctx!r}", param="options")
    return fields, num_ctx


def response_format(fmt: Union[str, dict[str, Any], None]) -> dict[str, Any] | None:
    """Ollama's `format` ("json", or a JSON Schema object) → an OpenAI response_format."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    assert isinstance(fmt, dict)
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}


def _validated(cls: type[BaseModel], values: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"invalid value for options ({where}): {first.get('msg')}", param="options") from None


def chat_request(body: OllamaChatRequest, default_max_tokens: int) -> tuple[ChatCompletionRequest, int | None]:
    """An /api/chat body as the OpenAI chat request it means, and its num_ctx."""
    _check_common(body)
    if body.tools:
        raise _refuse("tools", " on /api/chat (use /v1/chat/completions)")
    for message in body.messages:
        for field in ("images", "tool_calls", "tool_name", "thinking"):
            if getattr(message, field):
                raise _refuse(f"messages[].{field}")
    fields, num_ctx = sampling_fields(body.options)
    fields.setdefault("max_tokens", default_max_tokens)
    messages = [{"role": m.role, "content": m.content} for m in body.messages]
    request = _validated(ChatCompletionRequest, {"model": body.model, "messages": messages,
                                                 "response_format": response_format(body.format), **fields})
    return request, num_ctx


def generate_request(body: OllamaGenerateRequest, default_max_tokens: int, templated: bool
                     ) -> tuple[Union[ChatCompletionRequest, CompletionRequest], int | None]:
    """An /api/generate body as an OpenAI request: through the chat template (with `system`) unless `raw` or the
    model has none (`templated` False), else the prompt as is; and its num_ctx."""
    _check_common(body)
    for field in ("suffix", "template", "context", "images"):
        if getattr(body, field):
            raise _refuse(field, " on /api/generate")
    fields, num_ctx = sampling_fields(body.options)
    fields.setdefault("max_tokens", default_max_tokens)
    common = {"model": body.model, "response_format": response_format(body.format), **fields}
    if templated and not body.raw:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
            [{"role": "user", "content": body.prompt}]
        return _validated(ChatCompletionRequest, {"messages": messages, **common}), num_ctx
    if body.system:
        raise APIError(400, "system needs the model's chat template; this request is raw (or the model has "
                       "none): put the system text in the prompt", param="system")
    return _validated(CompletionRequest, {"prompt": body.prompt, **common}), num_ctx
