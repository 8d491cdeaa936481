"""The server side of hybrid routing: decide local vs remote per request, fall back, and say where it ran.

Every routed response carries the header ``X-Edgellm-Route`` (``local`` or ``remote:NAME``) and an
``edgellm`` extension object ``{"route", "reason", "fallback"}`` in the JSON body, or in each streamed chunk
that carries a finish_reason or usage. ``/metrics`` counts routes and fallbacks.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from edgellm.router.decide import (ROUTE_HEADER, Decision, MarkerError, RequestFacts, decide, device_state,
                                   request_tags)
from edgellm.router.policy import LOCAL, Policy
from edgellm.router.remote import RemoteFailure, RemoteStream, open_stream, post
from edgellm.serve.errors import APIError

# Local answers that mean "the engine could not do it" (not "the request is wrong"): these may fall back.
LOCAL_FAILURE_STATUSES = frozenset({408, 429, 500, 503, 504})

LocalServe = Callable[[float | None], Awaitable[Response]]


class LocalTimeout(Exception):
    """The local engine did not produce its first token (streams) or its reply within the policy's limit."""


def _prompt_tokens(engine: Any, raw: dict[str, Any], chat: bool) -> int:
    """The prompt's length in tokens with the local tokenizer (a character estimate when it is unavailable)."""
    try:
        if chat:
            return len(engine.encode(engine.render(raw["messages"])))
        prompt = raw.get("prompt", "")
        if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
            return len(prompt)
        texts = [prompt] if isinstance(prompt, str) else prompt
        return max(len(engine.encode(t)) for t in texts)
    except Exception:  # noqa: BLE001 - no engine yet, or a message shape the template refuses: estimate
        text = json.dumps(raw.get("messages") if chat else raw.get("prompt"), ensure_ascii=False)
        return len(text) // 3


def _facts(request: Request, raw: dict[str, Any], chat: bool, power_mode: str, task: str | None,
           private: bool) -> RequestFacts:
    state = request.app.state.edgellm
    tier, free = device_state()
    max_tokens = raw.get("max_completion_tokens") or raw.get("max_tokens")
    schema = isinstance(raw.get("response_format"), dict) and raw["response_format"].get("type") == "json_schema"
    return RequestFacts(
        prompt_tokens=_prompt_tokens(state.engine, raw, chat),
        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        task=task,
        private=private,
        device_tier=tier,
        free_memory_mib=free,
        power_mode=power_mode,
        queue_depth=state.metrics.queue_depth(),
        wants_json_schema=schema,
    )


def _info(route: str, reason: str, fallback: str | None) -> dict[str, Any]:
    return {"route": route, "reason": reason, "fallback": fallback}


def _annotate_json(payload: dict[str, Any], info: dict[str, Any], status: int = 200) -> JSONResponse:
    return JSONResponse({**payload, "edgellm": {**payload.get("edgellm", {}), **info}}, status_code=status,
                        headers={ROUTE_HEADER: info["route"]})


async def _annotated_lines(lines: AsyncIterator[str], info: dict[str, Any]) -> AsyncIterator[bytes]:
    """SSE lines passed through, with the route info added to final (finish_reason or usage) chunks."""
    async for line in lines:
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                data = json.loads(line[5:])
            except ValueError:
                data = None
            if isinstance(data, dict) and (data.get("usage") or any(
                    isinstance(c, dict) and c.get("finish_reason") for c in data.get("choices") or [])):
                line = "data: " + json.dumps({**data, "edgellm": info}, ensure_ascii=False)
        yield (line + "\n").encode("utf-8") if line else b"\n"


async def _body_lines(body: AsyncIterable[str | bytes | memoryview]) -> AsyncIterator[str]:
    buffer = ""
    async for part in body:
        buffer += part if isinstance(part, str) else bytes(part).decode("utf-8")
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line
    if buffer:
        yield buffer


def _with_route(response: Response, info: dict[str, Any]) -> Response:
    """The local response, marked with where it ran."""
    if isinstance(response, StreamingResponse):
        stream = StreamingResponse(_annotated_lines(_body_lines(response.body_iterator), info),
                                   status_code=response.status_code, media_type="text/event-stream")
        stream.headers.update({k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")})
        stream.headers[ROUTE_HEADER] = info["route"]
        return stream
    if isinstance(response, JSONResponse) and response.status_code == 200:
        return _annotate_json(json.loads(bytes(response.body)), info)
    response.headers[ROUTE_HEADER] = info["route"]
    return response


def _error_text(response: Response) -> str:
    try:
        return str(json.loads(bytes(response.body))["error"]["message"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"HTTP {response.status_code}"


def request_markers(request: Request, metadata: dict[str, Any] | None) -> tuple[str | None, bool]:
    """(task, private) from the request's routing markers; 400 naming the accepted values for a bad one.

    Checked on every generation request, routed or not, so a mistyped marker is found before it matters."""
    try:
        return request_tags(request.headers, {"metadata": metadata})
    except MarkerError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_routing_marker") from None


class RoutedServe:
    """One request through the policy: local or remote first, then the fallbacks the policy allows."""

    def __init__(self, request: Request, raw: dict[str, Any], chat: bool, policy: Policy, power_mode: str,
                 serve_local: LocalServe, tags: tuple[str | None, bool]) -> None:
        self.request = request
        self.tags = tags  # (task, private), from request_markers
        self.raw = raw
        self.chat = chat
        self.policy = policy
        self.serve_local = serve_local
        self.metrics = request.app.state.edgellm.metrics
        self.path = "/chat/completions" if chat else "/completions"
        self.power_mode = power_mode

    async def run(self) -> Response:
        # templating + tokenizing the prompt to count it: off the event loop, as the local path does
        facts = await asyncio.to_thread(_facts, self.request, self.raw, self.chat, self.power_mode, *self.tags)
        decision = decide(self.policy, facts)
        self.metrics.count("edgellm_routes_total", target=decision.target, reason=decision.reason)
        if decision.is_local:
            return await self._local_first(decision, private=facts.private)
        return await self._remote_first(decision)

    async def _local(self, decision: Decision, fallback: str | None) -> Response:
        timeout = None if fallback is not None else self.policy.fallback.local_timeout_s
        return _with_route(await self.serve_local(timeout), _info(LOCAL, decision.reason, fallback))

    async def _local_first(self, decision: Decision, *, private: bool) -> Response:
        fb = self.policy.fallback
        may_leave = not private
        try:
            response = await self.serve_local(fb.local_timeout_s if fb.local_timeout and may_leave else None)
        except LocalTimeout:
            why, target, local_error = "local_timeout", fb.local_timeout, f"no reply within {fb.local_timeout_s:g} s"
        else:
            why, target, local_error = "local_error", fb.local_error, _error_text(response)
            if response.status_code not in LOCAL_FAILURE_STATUSES or target is None or not may_leave:
                return _with_route(response, _info(LOCAL, decision.reason, None))
        assert target is not None  # a timeout is only set when the policy names its fallback
        self.metrics.count("edgellm_route_fallbacks_total", source=LOCAL, target=target, why=why)
        try:
            return await self._remote(target, _info(f"remote:{target}", decision.reason, why))
        except RemoteFailure as exc:
            raise APIError(502, f"the local engine failed ({local_error}) and so did the fallback: {exc}",
                           type="server_error", code="all_routes_failed") from None

    async def _remote_first(self, decision: Decision) -> Response:
        fb = self.policy.fallback
        try:
            return await self._remote(decision.target, _info(f"remote:{decision.target}", decision.reason, None))
        except RemoteFailure as exc:
            allowed = fb.remote_rejects_schema if exc.schema_rejected else fb.remote_error
            if allowed != LOCAL:
                raise APIError(502 if exc.status is None or exc.status >= 500 else exc.status, str(exc),
                               type="server_error", code="remote_error") from None
            why = "remote_rejects_schema" if exc.schema_rejected else "remote_error"
            self.metrics.count("edgellm_route_fallbacks_total", source=decision.target, target=LOCAL, why=why)
            response = await self._local(decision, why)
            if response.status_code in LOCAL_FAILURE_STATUSES:
                raise APIError(502, f"{exc}; the local fallback failed too ({_error_text(response)})",
                               type="server_error", code="all_routes_failed") from None
            return response

    async def _remote(self, name: str, info: dict[str, Any]) -> Response:
        remote = self.policy.remotes[name]
        if not self.raw.get("stream"):
            return _annotate_json(await post(remote, self.path, self.raw), info)
        stream: RemoteStream = await open_stream(remote, self.path, self.raw)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in _annotated_lines(stream.lines(), info):
                    yield chunk
            except RemoteFailure as exc:  # headers are sent: the error goes out as the last event
                yield b"data: " + json.dumps(APIError(502, str(exc), type="server_error").body()).encode() + b"\n\n"
            finally:
                await stream.close()

        return StreamingResponse(relay(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", ROUTE_HEADER: info["route"]})


_Event = TypeVar("_Event")


async def wait_first(events: AsyncIterator[_Event], timeout_s: float | None, cancel: Callable[[], None]) -> _Event:
    """The first event, or LocalTimeout (after cancelling the job) when it takes longer than `timeout_s`."""
    if timeout_s is None:
        return await events.__anext__()
    try:
        return await asyncio.wait_for(events.__anext__(), timeout_s)
    except asyncio.TimeoutError:
        cancel()
        raise LocalTimeout() from None
