"""The app factory: engine loading in the background, auth, body cap, metrics, and the small endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from importlib import resources
import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from edgellm.router.policy import Policy
from edgellm.serve.errors import APIError, install_handlers
from edgellm.serve.limits import Limits
from edgellm.serve.metrics import Metrics
from edgellm.serve.queue import Scheduler
from edgellm.serve.routes import router

log = logging.getLogger("edgellm.serve")
MAX_BODY_BYTES = Limits.max_body_bytes
# The page loads nothing from elsewhere (the server is offline) and may only talk back to this server.
_PLAYGROUND_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                   "img-src 'self' data:; base-uri 'none'; form-action 'none'")
ENDPOINTS = ("/", "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class ServerState:
    """The engine (once loaded), its scheduler and the metrics; one per app."""

    def __init__(self, loader: Callable[[], Any], model_name: str, *, max_queue: int, timeout_s: float,
                 limits: Limits | None = None, policy: Policy | None = None, power_mode: str = "performance",
                 fallback: Callable[[Any, str], str] | None = None) -> None:
        self.loader = loader
        self.limits = limits or Limits()
        self.policy = policy
        self.power_mode = power_mode
        self.fallback = fallback  # serve --fallback: answers when the model cannot (serve/fallback.py)
        self.model_name = model_name
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.metrics = Metrics()
        self.engine: Any = None
        self.scheduler: Scheduler | None = None
        self.load_error: str | None = None
        self.created = int(time.time())

    def load(self) -> None:
        """Load the engine (run in a background thread, so /health can answer 503 meanwhile)."""
        try:
            engine = self.loader()
            self.scheduler = Scheduler(engine, self.metrics, max_queue=self.max_queue, timeout_s=self.timeout_s)
            self.engine = engine
            log.info("model %s ready", self.model_name)
        except Exception as exc:  # noqa: BLE001 - reported by /health and every request
            self.load_error = str(exc)
            log.error("loading %s failed: %s", self.model_name, self.load_error)

    def ready(self) -> tuple[Any, Scheduler]:
        if self.engine is None or self.scheduler is None:
            message = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, message, type="server_error", code="model_not_ready")
        return self.engine, self.scheduler

    def names(self) -> set[str]:
        return {self.model_name} | ({self.engine.name} if self.engine is not None else set())

    def check_model(self, name: str) -> None:
        if name not in self.names():
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           type="not_found_error", param="model", code="model_not_found")


class EdgeMiddleware:
    """Pure ASGI: bearer-key check on /v1/*, request-body cap (413), and request counts by status."""

    def __init__(self, app: Any, state: ServerState, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key
        self.max_body = max_body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        status = {"code": 500}

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            rejected = self._reject(scope, path)
            if rejected is not None:
                await rejected(scope, receive, counting_send)
                return
            await self.app(scope, self._capped(receive), counting_send)
        finally:
            self.state.metrics.request(endpoint, status["code"])

    def _reject(self, scope: dict[str, Any], path: str) -> Response | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and path.startswith("/v1/"):
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key").response()
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            return _too_large(self.max_body).response()
        return None

    def _capped(self, receive: Any) -> Any:
        seen = {"bytes": 0}

        async def capped() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                seen["bytes"] += len(message.get("body", b""))
                if seen["bytes"] > self.max_body:
                    raise _too_large(self.max_body)
            return message

        return capped


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")


def create_app(loader: Callable[[], Any], model_name: str, *, api_key: str | None = None, max_queue: int = 8,
               timeout_s: float = 300.0, max_body_bytes: int | None = None, limits: Limits | None = None,
               policy: Policy | None = None, power_mode: str = "performance",
               fallback: Callable[[Any, str], str] | None = None) -> FastAPI:
    """An OpenAI-compatible app; `loader()` returns the engine and runs in a background thread at startup.

    `limits` caps what one request may ask for; `max_body_bytes`, when given, overrides its body size.
    With a routing `policy`, requests may go to remote endpoints (see edgellm.serve.routing); `fallback`
    answers, flagged, when the local model cannot (see edgellm.serve.fallback)."""
    limits = limits or Limits()
    if max_body_bytes is not None:
        limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
    state = ServerState(loader, model_name, max_queue=max_queue, timeout_s=timeout_s, limits=limits, policy=policy,
                        power_mode=power_mode, fallback=fallback)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = threading.Thread(target=state.load, name="edgellm-load", daemon=True)
        loading.start()
        yield
        if loading.is_alive():  # stopping mid-load: exiting under the loader aborts the process (SIGABRT in C++)
            log.info("waiting for the model to finish loading before stopping")
            await asyncio.to_thread(loading.join)
        if state.scheduler is not None:
            state.scheduler.close()

    app = FastAPI(title="edgellm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.edgellm = state
    install_handlers(app)
    app.include_router(router)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.engine is not None:
            plan = getattr(state.engine, "plan", None)  # the memory plan (runtime/planner.py), when planned
            extra = {"memory_plan": plan.as_dict()} if plan is not None else {}
            return JSONResponse({"status": "ok", "model": state.model_name, **extra})
        status = "error" if state.load_error else "loading"
        return JSONResponse({"status": status, "model": state.model_name, "error": state.load_error},
                            status_code=503)

    playground = (resources.files("edgellm.serve") / "static" / "playground.html").read_text(encoding="utf-8")

    @app.get("/")
    async def index() -> HTMLResponse:
        """The web playground: one self-contained page that talks to this server's public API."""
        return HTMLResponse(playground, headers={"Content-Security-Policy": _PLAYGROUND_CSP})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "edgellm"}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card(state.model_name)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        state.check_model(model_id)
        return JSONResponse(card(model_id))

    app.add_middleware(EdgeMiddleware, state=state, api_key=api_key, max_body=limits.max_body_bytes)
    return app


def _check_name(model: str) -> None:
    """Fail at once, before binding, for a name that is neither a folder nor a catalog model."""
    from pathlib import Path

    from edgellm.catalog import CATALOG
    from edgellm.resolve import resolve_model, split_model_name

    if not Path(model).expanduser().is_dir() and split_model_name(str(model))[0] not in CATALOG:
        resolve_model(model, progress=False)  # raises ModelNotFoundError with the catalog's names


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int = 8, timeout_s: float = 300.0, threads: int | None = None,
          context_window: int | None = None, quantization: str | None = None, limits: Limits | None = None,
          route: str | None = None, kv_cache: str | None = None, memory_budget: int | None = None,
          degrade: bool = False, fallback: str | None = None, power: str | None = None,
          runtime: str | None = None, prompt_cache: int | None = None, prompt_cache_dir: str | None = None,
          speculative: str | None = None) -> None:
    """Run the server until interrupted (the engine loads while /health answers 503); `prompt_cache`,
    `prompt_cache_dir` and `speculative` as Engine takes them (runtime/prompt_cache.py, runtime/speculative.py)."""
    import uvicorn

    from edgellm.router.policy import load_policy
    from edgellm.runtime.engine import Engine
    from edgellm.runtime.fallback import load_rule

    rule = load_rule(fallback) if fallback else None  # a bad MODULE:FUNCTION fails before binding

    def loader() -> Any:
        engine = Engine.load(model, quantization=quantization, threads=threads, context_window=context_window,
                             progress=False, kv_cache=kv_cache, memory_budget=memory_budget, degrade=degrade,
                             power=power, runtime=runtime, prompt_cache=prompt_cache,
                             prompt_cache_dir=prompt_cache_dir, speculative=speculative)
        if engine.plan is not None:
            log.info("%s", engine.plan.message())
        return engine

    _check_name(model)
    policy = load_policy(route) if route else None  # a bad policy file fails here, before binding

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this address can use the model", host)
    app = create_app(loader, str(model), api_key=api_key, max_queue=max_queue, timeout_s=timeout_s, limits=limits,
                     policy=policy, power_mode=power or "performance", fallback=rule)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
