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
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgellm.errors import MemoryBudgetError, ModelNotFoundError
from edgellm.router.policy import Policy
from edgellm.router.redact import RedactingFilter, remote_secrets
from edgellm.serve.errors import APIError, install_handlers
from edgellm.serve.hosts import HostAllowList
from edgellm.serve.limits import Limits
from edgellm.serve.metrics import Metrics
from edgellm.serve.model_host import DEFAULT_KEEP_ALIVE_S, KeepAlive, ModelHost, Resident
from edgellm.serve.ollama import OLLAMA_ENDPOINTS, ollama_router
from edgellm.serve.queue import Scheduler
from edgellm.serve.completions import router
from edgellm.serve.transport import Connections

if TYPE_CHECKING:
    from edgellm.runtime.engine import Engine

log = logging.getLogger("edgellm.serve")
MAX_BODY_BYTES = Limits.max_body_bytes
# The page loads nothing from elsewhere (the server is offline) and may only talk back to this server.
_PLAYGROUND_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                   "img-src 'self' data:; base-uri 'none'; form-action 'none'")
ENDPOINTS = ("/", "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics") + OLLAMA_ENDPOINTS


class ServerState:
    """The server's models (serve/model_host.py: its own, loaded at startup, and any other local model, loaded
    on first request by name), their schedulers and the metrics; one per app."""

    def __init__(self, loader: Callable[[], Engine], model_name: str, *, max_queue: int, timeout_s: float,
                 limits: Limits | None = None, policy: Policy | None = None, power_mode: str = "performance",
                 fallback: Callable[[Any, str], str] | None = None,
                 load_model: Callable[[Path], Engine] | None = None, keep_alive: KeepAlive | None = None,
                 models_budget: int | None = None, clock: Callable[[], float] = time.time,
                 max_batch: int | None = None) -> None:
        self.loader = loader
        self.limits = limits or Limits()
        self.policy = policy
        self.power_mode = power_mode
        self.fallback = fallback  # serve --fallback: answers when the model cannot (serve/rule_answer.py)
        self.model_name = model_name
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.metrics = Metrics()
        self.load_model = load_model  # opens another local model's folder; None: this server serves one model
        self.primary_keep_alive = keep_alive or KeepAlive(None)  # its own model stays unless told otherwise
        self.primary_folder: Path | None = None
        self.host = ModelHost(self.locate_model, self._open, self.metrics, max_queue=max_queue, timeout_s=timeout_s,
                              budget=models_budget, keep_alive=keep_alive or KeepAlive(DEFAULT_KEEP_ALIVE_S),
                              clock=clock, max_batch=max_batch)
        self.load_error: str | None = None
        self.created = int(time.time())

    def load(self) -> None:
        """Load the engine (run in a background thread, so /health can answer 503 meanwhile)."""
        try:
            t0 = time.perf_counter()
            engine = self.loader()
            self.primary_folder = Path(engine.artifact.folder)
            self.host.adopt((self.model_name, engine.name), engine, self.primary_keep_alive, time.perf_counter() - t0)
            log.info("model %s ready", self.model_name)
        except Exception as exc:  # noqa: BLE001 - reported by /health and every request
            self.load_error = str(exc)
            log.error("loading %s failed: %s", self.model_name, self.load_error)

    @property
    def engine(self) -> Engine | None:
        """The server's own model's engine while it is resident, else None."""
        resident = self.host.find(self.model_name)
        return resident.engine if resident is not None else None

    def ready(self) -> tuple[Engine, Scheduler]:
        resident = self.host.find(self.model_name)
        if resident is None:
            message = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, message, type="server_error", code="model_not_ready")
        return resident.engine, resident.scheduler

    async def ready_for(self, name: str) -> tuple[Engine, Scheduler]:
        """The engine and scheduler serving `name`, loading it first where it is a local model not resident."""
        resident = await self.acquire(name)
        resident.reserve()  # the caller submits its job next: no keep-alive may unload the model before
        self.host.release(resident)
        return resident.engine, resident.scheduler

    async def acquire(self, name: str, keep_alive: KeepAlive | None = None) -> Resident:
        """The resident model `name`, loaded first if needed (pair with host.release); APIError 404/503 if not."""
        name = name[: -len(":latest")] if name.endswith(":latest") else name  # Ollama's default tag
        if name in self.names() and self.primary_folder is None:
            self.ready()  # still loading at startup, or failed: 503 saying which
        if name not in self.names() and self.load_model is None:
            self.check_model(name)
        try:
            return await self.host.acquire(name, keep_alive)
        except ModelNotFoundError as exc:
            raise APIError(404, str(exc), type="not_found_error", param="model", code="model_not_found") from None
        except MemoryBudgetError as exc:
            raise APIError(503, str(exc), type="server_error", code="memory_budget") from None

    def locate_model(self, name: str) -> tuple[Path, int]:
        """The artifact folder `name` serves (already on disk: nothing is pulled here) and its memory estimate."""
        from edgellm.artifact.config import ArtifactConfig
        from edgellm.inventory import find_local
        from edgellm.runtime.memory import estimate_memory

        folder = self.primary_folder if name in self.names() else find_local(name)
        if folder is None:
            raise ModelNotFoundError(f"model {name!r} is not on this machine; pull it first (`edgellm pull`, "
                                     "or POST /api/pull); `edgellm list` shows the local models")
        return folder, estimate_memory(ArtifactConfig.read(folder)).total_bytes

    def _open(self, name: str, folder: Path) -> Engine:
        if folder == self.primary_folder:
            return self.loader()
        assert self.load_model is not None
        return self.load_model(folder)

    def names(self) -> set[str]:
        names = {self.model_name}
        if self.primary_folder is not None:
            names.add(self.primary_folder.name)
        return names

    def check_model(self, name: str) -> None:
        if name not in self.names():
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           type="not_found_error", param="model", code="model_not_found")


class EdgeMiddleware:
    """Pure ASGI, around every route: the Host allow-list (421), the bearer-key check on /v1/*, the request-body
    cap (413) and deadline (408), and request counts by status."""

    def __init__(self, app: ASGIApp, state: ServerState, api_key: str | None, max_body: int,
                 hosts: HostAllowList, body_timeout_s: float) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key
        self.max_body = max_body
        self.hosts = hosts
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
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

    def _reject(self, scope: Scope, path: str) -> Response | None:
        pairs = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", [])]
        # no Host at all: an HTTP/1.0 client, never a browser (h11 refuses an HTTP/1.1 request without one)
        refused = next((v for k, v in pairs if k == "host" and not self.hosts.allows(v)), None)
        if refused is not None:
            return APIError(421, f"this server does not answer for Host {refused[:100]!r}; it answers "
                                 f"{self.hosts.described()} (add a name with `edgellm serve --allowed-host NAME`)",
                            code="host_not_allowed", headers={"Connection": "close"}).response()
        headers = dict(pairs)
        if self.api_key and path.startswith(("/v1/", "/api/")):
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key").response()
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            return _too_large(self.max_body).response()
        return None

    def _capped(self, receive: Receive) -> Receive:
        """`receive` with the body's size cap and its deadline (counted from the request head's arrival)."""
        seen = {"bytes": 0, "done": False}
        deadline = time.monotonic() + self.body_timeout_s

        async def capped() -> Message:
            if seen["done"]:  # after the body: waiting for a disconnect, which has no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s (set by "
                                    "`edgellm serve --body-timeout`)", type="timeout_error", code="body_timeout",
                               headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                seen["bytes"] += len(message.get("body", b""))
                if seen["bytes"] > self.max_body:
                    raise _too_large(self.max_body)
                seen["done"] = not message.get("more_body", False)
            else:
                seen["done"] = True
            return message

        return capped


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")


def create_app(loader: Callable[[], Engine], model_name: str, *, api_key: str | None = None, max_queue: int = 8,
               timeout_s: float = 300.0, max_body_bytes: int | None = None, limits: Limits | None = None,
               policy: Policy | None = None, power_mode: str = "performance",
               fallback: Callable[[Any, str], str] | None = None, hosts: HostAllowList | None = None,
               connections: Connections | None = None, load_model: Callable[[Path], Engine] | None = None,
               keep_alive: KeepAlive | None = None, models_budget: int | None = None,
               clock: Callable[[], float] = time.time, max_batch: int | None = None) -> FastAPI:
    """An OpenAI- and Ollama-compatible app; `loader()` returns the engine and runs in a background thread at
    startup. With `load_model` (an artifact folder → engine), any other local model is served too, loaded on its
    first request and unloaded after `keep_alive` idle (default 5 minutes), within `models_budget` bytes
    (default: the free memory); the server's own model stays loaded unless `keep_alive` says otherwise.

    `limits` caps what one request may ask for; `max_body_bytes`, when given, overrides its body size.
    `hosts` are the Host headers it answers (default: loopback names); `connections` gives the body deadline.
    With a routing `policy`, requests may go to remote endpoints (see edgellm.serve.hybrid); `fallback`
    answers, flagged, when the local model cannot (see edgellm.serve.rule_answer). Each model decodes as many
    sequences at once as its engine's memory plan counts KV caches for (`engine.memory.sequences`, runtime/batching.py),
    at most `max_batch` rows per step (default: all of them)."""
    limits = limits or Limits()
    if max_body_bytes is not None:
        limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
    state = ServerState(loader, model_name, max_queue=max_queue, timeout_s=timeout_s, limits=limits, policy=policy,
                        power_mode=power_mode, fallback=fallback, load_model=load_model, keep_alive=keep_alive,
                        models_budget=models_budget, clock=clock, max_batch=max_batch)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = threading.Thread(target=state.load, name="edgellm-load", daemon=True)
        loading.start()
        yield
        if loading.is_alive():  # stopping mid-load: exiting under the loader aborts the process (SIGABRT in C++)
            log.info("waiting for the model to finish loading before stopping")
            await asyncio.to_thread(loading.join)
        state.host.shutdown()

    app = FastAPI(title="edgellm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.edgellm = state
    install_handlers(app)
    app.include_router(router)
    app.include_router(ollama_router)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.engine is not None:
            plan = getattr(state.engine, "plan", None)  # the memory plan (runtime/planner.py), when planned
            extra = {"memory_plan": plan.as_dict()} if plan is not None else {}
            return JSONResponse({"status": "ok", "model": state.model_name, **extra})
        if state.primary_folder is not None:  # unloaded after its keep-alive: the next request loads it again
            return JSONResponse({"status": "ok", "model": state.model_name, "loaded": False})
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

    def served() -> list[str]:
        """The server's own model, then every local model it can load (edgellm/inventory.py)."""
        names = [state.model_name]
        if state.load_model is not None:
            from edgellm.inventory import local_models

            names += [m.name for m in local_models(runnable_only=True) if m.name not in names]
        return names

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        names = await asyncio.to_thread(served)
        return JSONResponse({"object": "list", "data": [card(name) for name in names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id not in state.names() and model_id not in await asyncio.to_thread(served):
            state.check_model(model_id)
        return JSONResponse(card(model_id))

    app.add_middleware(EdgeMiddleware, state=state, api_key=api_key, max_body=limits.max_body_bytes,
                       hosts=hosts or HostAllowList(), body_timeout_s=(connections or Connections()).body_timeout_s)
    return app


def _check_name(model: str) -> None:
    """Fail at once, before binding, for a name that is neither a folder nor a catalog model."""
    from pathlib import Path

    from edgellm.catalog import CATALOG
    from edgellm.resolve import resolve_model, split_model_name

    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        resolve_model(model, progress=True)  # compiled on first use, before binding, with its progress line
    elif not path.is_dir() and split_model_name(str(model))[0] not in CATALOG:
        resolve_model(model, progress=False)  # raises ModelNotFoundError with the catalog's names


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int = 8, timeout_s: float = 300.0, threads: int | None = None,
          context_window: int | None = None, quantization: str | None = None, limits: Limits | None = None,
          route: str | None = None, kv_cache: str | None = None, memory_budget: int | None = None,
          degrade: bool = False, fallback: str | None = None, power: str | None = None,
          runtime: str | None = None, allowed_hosts: Sequence[str] = (),
          connections: Connections | None = None, keep_alive: KeepAlive | None = None,
          prompt_cache: int | None = None, prompt_cache_dir: str | None = None,
          speculative: str | None = None, parallel: int | None = None, max_batch: int | None = None) -> None:
    """Run the server until interrupted (the engine loads while /health answers 503). Other local models are
    served on request by name, within `memory_budget` across them all (serve/model_host.py). `prompt_cache`,
    `prompt_cache_dir` and `speculative` as Engine takes them (session/prompt_cache.py, session/speculative.py):
    the prompt cache is the first model's, speculative decoding every model's. `parallel` sequences decode at once
    (runtime/batching.py; None: DEFAULT_PARALLEL, fewer where the memory planner finds they do not fit), at most
    `max_batch` rows per step."""
    import uvicorn

    from edgellm.router.policy import load_policy
    from edgellm.runtime.engine import Engine
    from edgellm.runtime.rule_answer import load_rule
    from edgellm.serve.transport import uvicorn_config

    rule = load_rule(fallback) if fallback else None  # a bad MODULE:FUNCTION fails before binding

    check_batching(parallel, max_batch)  # a bad --parallel/--max-batch fails before binding
    if parallel is not None and parallel > 1:  # and N sequences' KV caches that do not fit, too
        from edgellm.runtime.planner import plan_load
        from edgellm.session.prompt_cache import prompt_cache_budget

        plan_load(model, quantization=quantization, context_window=context_window, kv_cache=kv_cache,
                  memory_budget=memory_budget, degrade=degrade, progress=True, sequences=parallel,
                  reserved=prompt_cache_budget(prompt_cache, prompt_cache_dir))

    def loader() -> Engine:
        def load(sequences: int) -> Engine:
            return Engine.load(model, quantization=quantization, threads=threads, context_window=context_window,
                               progress=False, kv_cache=kv_cache, memory_budget=memory_budget, degrade=degrade,
                               power=power, runtime=runtime, prompt_cache=prompt_cache,
                               prompt_cache_dir=prompt_cache_dir, speculative=speculative, sequences=sequences)

        engine = load_batched(load, parallel)
        if engine.plan is not None:
            log.info("%s", engine.plan.message())
        log.info("decoding up to %d sequences at once, %d rows per step", engine.memory.sequences,
                 min(max_batch or engine.memory.sequences, engine.memory.sequences))
        return engine

    _check_name(model)
    policy = load_policy(route) if route else None  # a bad policy file fails here, before binding
    hosts = HostAllowList.for_bind(host, allowed_hosts)  # a bad --allowed-host too
    connections = connections or Connections()

    def load_model(folder: Path) -> Engine:
        return load_batched(lambda sequences: Engine.load(folder, threads=threads, progress=False, kv_cache=kv_cache,
                                                          power=power, runtime=runtime, speculative=speculative,
                                                          sequences=sequences), parallel)

    _check_port(host, port)
    app = create_app(loader, str(model), api_key=api_key, max_queue=max_queue, timeout_s=timeout_s, limits=limits,
                     policy=policy, power_mode=power or "performance", fallback=rule, hosts=hosts,
                     connections=connections, load_model=load_model, keep_alive=keep_alive,
                     models_budget=memory_budget, max_batch=max_batch)
    config = uvicorn_config(app, host=host, port=port, limits=connections)  # configures uvicorn's loggers
    secrets = [s for remote in (policy.remotes.values() if policy else ()) for s in remote_secrets(remote)]
    configure_logging(secrets)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this address can use the model", host)
    log.info("answering requests for Host %s", hosts.described())
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has stopped: a clean exit
        pass
    if not server.started:
        raise SystemExit(3)  # could not bind: uvicorn logged why (as uvicorn.run exits)


DEFAULT_PARALLEL = 4  # sequences decoded at once when --parallel is not given


def check_batching(parallel: int | None, max_batch: int | None) -> None:
    """A one-line EdgeLLMError for a --parallel or --max-batch the batch cannot take."""
    from edgellm.errors import EdgeLLMError

    if parallel is not None and parallel < 1:
        raise EdgeLLMError(f"--parallel {parallel}: at least 1 sequence must decode")
    if max_batch is not None and max_batch < 1:
        raise EdgeLLMError(f"--max-batch {max_batch}: a decode step takes at least 1 row")
    if max_batch is not None and max_batch > (parallel or DEFAULT_PARALLEL):
        raise EdgeLLMError(f"--max-batch {max_batch} is more than --parallel {parallel or DEFAULT_PARALLEL}: a step "
                           "takes at most one row per sequence")


def load_batched(load: Callable[[int], Any], parallel: int | None) -> Any:
    """`load(sequences)` for `parallel` sequences (its MemoryBudgetError when they do not fit), or, with None, for
    DEFAULT_PARALLEL, halving until the memory planner finds room (logged: never fewer in silence)."""
    from edgellm.errors import MemoryBudgetError

    if parallel is not None:
        return load(parallel)
    sequences = DEFAULT_PARALLEL
    while True:
        try:
            return load(sequences)
        except MemoryBudgetError as exc:
            if sequences == 1:
                raise
            log.warning("%d sequences at once do not fit (%s); trying %d", sequences, exc, sequences // 2)
            sequences //= 2


def configure_logging(secrets: Sequence[str] = ()) -> None:
    """The server's logging: INFO lines on stderr, no third-party request lines (httpx logs every URL it calls,
    credentials included, at INFO), and every line through the credential filter."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    guard = RedactingFilter(secrets)
    for logger in (None, "uvicorn", "uvicorn.error", "uvicorn.access"):
        for handler in logging.getLogger(logger).handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(guard)


def _check_port(host: str, port: int) -> None:
    """A port another process listens on is a one-line error before anything loads (not uvicorn's traceback)."""
    import socket

    from edgellm.errors import EdgeLLMError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise EdgeLLMError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; stop what holds the port "
                               "or pick another with --port") from None
