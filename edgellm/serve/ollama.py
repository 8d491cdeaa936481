"""Ollama-compatible endpoints (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/pull, /api/delete,
/api/version), so tools written for Ollama use edgellm unchanged.

Generation goes through the same conversion, limits, scheduler and structured-output path as the OpenAI routes
(ollama_protocol.py converts); responses are Ollama's: newline-delimited JSON objects when streamed (the last one
has done: true and the counts, durations in nanoseconds), one object otherwise, and errors as {"error": "..."}.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, TypeVar, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from edgellm.errors import ContextOverflowError
from edgellm.serve.engine_request import EngineRequest, to_engine
from edgellm.serve.errors import APIError, to_api_error
from edgellm.serve.limits import check_request
from edgellm.serve.model_host import KeepAlive, Resident, parse_keep_alive
from edgellm.serve.ollama_protocol import (OllamaChatRequest, OllamaGenerateRequest, OllamaModelRequest,
                                           chat_request, generate_request)
from edgellm.serve.queue import Event, Run

if TYPE_CHECKING:
    from pydantic import BaseModel

    from edgellm.artifact.config import ArtifactConfig

    from edgellm.serve.protocol import ChatCompletionRequest, CompletionRequest

_Body = TypeVar("_Body", bound="BaseModel")
ollama_router = APIRouter()
OLLAMA_ENDPOINTS = ("/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps", "/api/pull", "/api/delete",
                    "/api/version")
NDJSON = "application/x-ndjson"
NS = 1_000_000_000


def _error(exc: BaseException) -> JSONResponse:
    """Ollama's error body: {"error": message}, with the status the OpenAI routes would give."""
    error = to_api_error(exc)
    return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)


def _now() -> str:
    return _stamp(time.time())


def _stamp(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat().replace("+00:00", "Z")


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object a request carries. It must say Content-Type: application/json: the types a web page may
    send to another origin without asking (text/plain, forms) are refused, so no page can drive this API."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(415, f"send the body as JSON with Content-Type: application/json (got {kind or 'none'}; "
                       "with curl: -H 'Content-Type: application/json')", code="unsupported_media_type")
    try:
        data = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def _parse(cls: type[_Body], data: dict[str, Any]) -> _Body:
    from pydantic import ValidationError

    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "the request body"
        message = "is not a field of this endpoint" if first.get("type") == "extra_forbidden" else first.get("msg")
        raise APIError(400, f"{where}: {message}", param=where) from None


def _keep_alive(value: Union[float, str, None]) -> KeepAlive | None:
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise APIError(400, str(exc), param="keep_alive") from None


# ---- generation ------------------------------------------------------------------------------------------------
@ollama_router.post("/api/chat")
async def chat(request: Request) -> Response:
    return await _generate(request, chat=True)


@ollama_router.post("/api/generate")
async def generate(request: Request) -> Response:
    return await _generate(request, chat=False)


async def _generate(request: Request, *, chat: bool) -> Response:
    t0 = time.perf_counter()
    state = request.app.state.edgellm
    try:
        data = await _body(request)
        body: OllamaChatRequest | OllamaGenerateRequest = (
            _parse(OllamaChatRequest, data) if chat else _parse(OllamaGenerateRequest, data))
        keep = _keep_alive(body.keep_alive)
        resident = await state.acquire(body.model, keep)
    except Exception as exc:  # noqa: BLE001 - every failure becomes an Ollama error body
        return _error(exc)
    load_ns = int((time.perf_counter() - t0) * NS)
    streaming = False
    try:
        empty = not (body.messages if isinstance(body, OllamaChatRequest) else body.prompt)
        if empty:  # Ollama's way to load a model (or, with keep_alive 0, unload it) without generating
            unloading = keep is not None and keep.seconds == 0
            reply = _reply(body.model, chat, "", done_reason="unload" if unloading else "load")
            return JSONResponse(reply) if not body.stream else _lines([reply])
        engine = resident.engine
        default = engine.config.sampling.max_tokens
        wire: ChatCompletionRequest | CompletionRequest
        if isinstance(body, OllamaChatRequest):  # (as `chat` says)
            wire, num_ctx = chat_request(body, default)
        else:
            wire, num_ctx = generate_request(body, default, templated=bool(engine.chat_template))
        window = engine.context_window
        if num_ctx is not None and num_ctx > window:
            raise APIError(400, f"options.num_ctx {num_ctx} is over this model's context window of {window} "
                           "tokens", param="options")
        check_request(wire, state.limits, default, window)
        plan = await asyncio.to_thread(to_engine, wire, engine)
        plan = _within(plan, num_ctx)
        job = resident.scheduler.submit([Run(p, q) for p, q in zip(plan.prompts, plan.params)],
                                        asyncio.get_running_loop())
        from edgellm.serve.completions import _events  # the same event pump as the OpenAI routes

        events = _events(job, None)
        first = await events.__anext__()
        if first.kind == "error":
            job.cancel()
            return _error(first.error or RuntimeError("error event without an error"))
        pieces = _pieces(first, events, body.model, chat, t0, load_ns)
        if body.stream:
            streaming = True
            return StreamingResponse(_streamed(pieces, job, state.host, resident, keep), media_type=NDJSON)
        try:
            return await _whole(pieces, chat)
        finally:
            job.cancel()
    except Exception as exc:  # noqa: BLE001
        return _error(exc)
    finally:
        if not streaming:
            state.host.release(resident, keep)


def _within(plan: EngineRequest, num_ctx: int | None) -> EngineRequest:
    """With options.num_ctx, the prompt and its reply fit in num_ctx tokens: a longer prompt is refused, and the
    reply is capped at what is left (as a model loaded with that context would stop)."""
    if num_ctx is None:
        return plan
    params = []
    for prompt, p in zip(plan.prompts, plan.params):
        if len(prompt) >= num_ctx:
            raise ContextOverflowError(len(prompt), num_ctx)
        room = num_ctx - len(prompt)
        params.append(replace(p, max_tokens=min(p.max_tokens or room, room)))
    return replace(plan, params=tuple(params))


def _reply(model: str, chat: bool, text: str, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "created_at": _now()}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["response"] = text
    out["done"] = bool(extra)
    out.update(extra)
    return out


async def _pieces(first: Event, rest: AsyncIterator[Event], model: str, chat: bool, t0: float,
                  load_ns: int) -> AsyncIterator[dict[str, Any]]:
    """The response objects for a job's events: one per text piece, then the final one with the counts."""
    event = first
    while True:
        if event.kind == "error":
            raise event.error or RuntimeError("error event without an error")
        if event.kind == "end":
            return
        chunk = event.chunk
        if chunk is None:
            raise RuntimeError("chunk event without a chunk")
        if chunk.finish_reason is None:
            if chunk.text:
                yield _reply(model, chat, chunk.text)
        else:
            stats = chunk.stats
            done: dict[str, Any] = {"done_reason": chunk.finish_reason,
                                    "total_duration": int((time.perf_counter() - t0) * NS),
                                    "load_duration": load_ns}
            if stats is not None:
                done.update(prompt_eval_count=stats.prompt_tokens, prompt_eval_duration=int(stats.prefill_s * NS),
                            eval_count=stats.completion_tokens, eval_duration=int(stats.decode_s * NS))
            yield _reply(model, chat, chunk.text, **done)
        event = await rest.__anext__()


async def _whole(pieces: AsyncIterator[dict[str, Any]], chat: bool) -> JSONResponse:
    texts: list[str] = []
    last: dict[str, Any] = {}
    async for piece in pieces:
        texts.append(piece["message"]["content"] if chat else piece["response"])
        last = piece
    text = "".join(texts)
    if chat:
        last["message"] = {"role": "assistant", "content": text}
    else:
        last["response"] = text
    return JSONResponse(last)


async def _streamed(pieces: AsyncIterator[dict[str, Any]], job: Any, host: Any, resident: Resident,
                    keep: KeepAlive | None) -> AsyncIterator[bytes]:
    try:
        async for piece in pieces:
            yield _line(piece)
    except Exception as exc:  # noqa: BLE001 - the status is sent: the error goes out as the last line
        yield _line({"error": to_api_error(exc).message})
    finally:
        job.cancel()
        host.release(resident, keep)


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")


def _lines(objs: list[dict[str, Any]]) -> StreamingResponse:
    async def gen() -> AsyncIterator[bytes]:
        for obj in objs:
            yield _line(obj)

    return StreamingResponse(gen(), media_type=NDJSON)


# ---- models --------------------------------------------------------------------------------------------------
def _parameter_count(config: ArtifactConfig) -> int:
    """Weights in the model (embeddings, attention, MLP, norms), from its shapes."""
    m = config.model
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    layer = m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return embed + m.num_hidden_layers * layer + m.hidden_size


def _size_label(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _details(config: ArtifactConfig) -> dict[str, Any]:
    arch = config.model.architecture
    return {"parent_model": "", "format": "edgellm", "family": arch, "families": [arch],
            "parameter_size": _size_label(_parameter_count(config)), "quantization_level": config.quantization.scheme}


def _digest(folder: Path) -> str:
    from edgellm.artifact.config import MANIFEST_FILE

    try:
        return hashlib.sha256((folder / MANIFEST_FILE).read_bytes()).hexdigest()
    except OSError:
        return ""


def _card(name: str, folder: Path, size: int) -> dict[str, Any]:
    from edgellm.artifact.config import ArtifactConfig

    config = ArtifactConfig.read(folder)
    return {"name": name, "model": name, "modified_at": _stamp(folder.stat().st_mtime), "size": size,
            "digest": _digest(folder), "details": _details(config)}


def _tags(state: Any) -> dict[str, Any]:
    from edgellm.inventory import folder_size, local_models

    cards, seen = [], set()
    for resident in state.host.residents():  # the server's own model may live outside the cache
        cards.append(_card(resident.name, resident.folder, folder_size(resident.folder)))
        seen.add(resident.folder.resolve())
    if state.load_model is not None:
        for model in local_models(runnable_only=True):
            if model.path.resolve() not in seen:
                cards.append(_card(model.name, model.path, model.size_bytes))
    return {"models": cards}


@ollama_router.get("/api/tags")
async def tags(request: Request) -> Response:
    try:
        return JSONResponse(await asyncio.to_thread(_tags, request.app.state.edgellm))
    except Exception as exc:  # noqa: BLE001
        return _error(exc)


@ollama_router.get("/api/ps")
async def ps(request: Request) -> Response:
    out = []
    for r in request.app.state.edgellm.host.residents():
        config = r.engine.config
        expires = r.expires_at
        out.append({"name": r.name, "model": r.name, "size": r.size_bytes, "digest": _digest(r.folder),
                     "details": _details(config), "size_vram": 0, "context_length": r.engine.context_window,
                     "expires_at": _stamp(expires) if expires is not None else None})
    return JSONResponse({"models": out})


def _show(state: Any, name: str) -> dict[str, Any]:
    from dataclasses import asdict

    from edgellm.artifact.config import ArtifactConfig
    from edgellm.artifact.manifest import Manifest

    resident = state.host.find(name)
    folder = resident.folder if resident is not None else state.locate_model(name)[0]
    config = ArtifactConfig.read(folder)
    tuning = resident.engine.artifact.manifest.tuning if resident is not None else Manifest.read(folder).tuning
    template = resident.engine.chat_template if resident is not None else _chat_template(folder)
    sampling = asdict(config.sampling)
    arch = config.model.architecture
    return {
        "modelfile": "", "license": "", "template": template or "",
        "parameters": "\n".join(f"{k} {v}" for k, v in sampling.items()),
        "details": _details(config), "modified_at": _stamp(folder.stat().st_mtime),
        "model_info": {"general.architecture": arch, "general.parameter_count": _parameter_count(config),
                       f"{arch}.context_length": config.context_window,
                       f"{arch}.embedding_length": config.model.hidden_size,
                       f"{arch}.block_count": config.model.num_hidden_layers},
        "capabilities": ["completion"],
        "edgellm": {"sampling": sampling, "context_window": config.context_window, "folder": str(folder),
                    "tuning": tuning.as_dict()},
    }


def _chat_template(folder: Path) -> str | None:
    from edgellm.artifact.reader import open_artifact

    return open_artifact(folder, verify=False).chat_template


@ollama_router.post("/api/show")
async def show(request: Request) -> Response:
    try:
        body = _parse(OllamaModelRequest, await _body(request))
        state = request.app.state.edgellm
        name = body.model_name()
        if name not in state.names() and state.load_model is None:
            state.check_model(name)
        return JSONResponse(await asyncio.to_thread(_show, state, name))
    except Exception as exc:  # noqa: BLE001
        return _error(exc)


@ollama_router.post("/api/pull")
async def pull(request: Request) -> Response:
    """Pull and compile a catalog model (NAME or NAME:SCHEME) or compile a local GGUF file, as `edgellm pull`
    then first use would."""
    try:
        body = _parse(OllamaModelRequest, await _body(request))
        name = body.model_name()
        if request.app.state.edgellm.load_model is None:
            raise APIError(403, "this server serves only its own model; pulling is off")
        task = asyncio.create_task(asyncio.to_thread(_pull, name))
    except Exception as exc:  # noqa: BLE001
        return _error(exc)
    if not body.stream:
        try:
            await task
        except Exception as exc:  # noqa: BLE001
            return _error(exc)
        return JSONResponse({"status": "success"})

    async def progress() -> AsyncIterator[bytes]:
        yield _line({"status": f"pulling {name}"})
        try:
            await task
        except Exception as exc:  # noqa: BLE001
            yield _line({"error": to_api_error(exc).message})
            return
        yield _line({"status": "success"})

    return StreamingResponse(progress(), media_type=NDJSON)


def _pull(name: str) -> Path:
    from edgellm.catalog import CATALOG
    from edgellm.errors import ModelNotFoundError
    from edgellm.resolve import resolve_model, split_model_name

    name = name[: -len(":latest")] if name.endswith(":latest") else name
    path = Path(name).expanduser()
    if split_model_name(name)[0] not in CATALOG and not (path.suffix == ".gguf" and path.is_file()):
        raise ModelNotFoundError(f"cannot pull {name!r}: give a catalog model ({', '.join(sorted(CATALOG))}) or "
                                 "the path of a .gguf file on the server")
    return resolve_model(name, progress=False)


@ollama_router.delete("/api/delete")
async def delete(request: Request) -> Response:
    try:
        body = _parse(OllamaModelRequest, await _body(request))
        state = request.app.state.edgellm
        name = body.model_name()
        name = name[: -len(":latest")] if name.endswith(":latest") else name
        if state.load_model is None:
            raise APIError(403, "this server serves only its own model; deleting is off")
        resident = state.host.find(name)
        if resident is not None and not state.host.unload(resident.folder, when_idle=True):
            raise APIError(409, f"{name} is answering a request; retry when it is done")
        from edgellm.inventory import remove

        await asyncio.to_thread(remove, name)
        return JSONResponse({})
    except Exception as exc:  # noqa: BLE001
        return _error(exc)


@ollama_router.get("/api/version")
async def version() -> JSONResponse:
    from edgellm import __version__

    return JSONResponse({"version": __version__})
