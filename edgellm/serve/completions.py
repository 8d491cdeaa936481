"""The generation endpoints: /v1/chat/completions and /v1/completions, whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, AsyncIterator, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from edgellm.serve import responses as R
from edgellm.serve.engine_request import EngineRequest, to_engine
from edgellm.serve.errors import APIError, to_api_error
from edgellm.serve.rule_answer import fallback_response
from edgellm.serve.limits import check_request
from edgellm.serve.protocol import ChatCompletionRequest, CompletionRequest
from edgellm.serve.queue import Event, Job, Run
from edgellm.serve.hybrid import LocalTimeout, RoutedServe, request_markers, wait_first

if TYPE_CHECKING:
    from edgellm.runtime.engine import Engine

router = APIRouter()
POLL_S = 0.2  # how often a waiting request checks that its client is still there


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def _events(job: Job, request: Request | None) -> AsyncIterator[Event]:
    """The job's events until its end or error; with `request`, cancel the job if the client disconnects."""
    loop = asyncio.get_running_loop()
    next_check = loop.time() + POLL_S
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), POLL_S)
        except asyncio.TimeoutError:
            event = None
        if request is not None and loop.time() >= next_check:  # tokens may arrive faster than POLL_S
            next_check = loop.time() + POLL_S
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone()
        if event is None:
            continue
        yield event
        if event.kind != "chunk":
            return


def _engine_error(event: Event, plan: EngineRequest) -> APIError:
    """The error event's API error; a schema refused under a forced tool choice is the tools' fault."""
    error = to_api_error(event.error or RuntimeError("error event without an error"))
    if plan.tool_mode == "forced" and error.param == "response_format":
        error.param = "tools"
    return error


def _failed(request: Request, body: Union[ChatCompletionRequest, CompletionRequest], error: APIError, *,
            chat: bool) -> Response:
    """The error's response, or the server's --fallback answer when the failure is the server's."""
    state = request.app.state.edgellm
    return fallback_response(state.fallback, state.model_name, body, error, chat=chat) or error.response()


async def _submit(request: Request,
                  body: Union[ChatCompletionRequest, CompletionRequest]) -> tuple[Engine, EngineRequest, Job]:
    state = request.app.state.edgellm
    engine, scheduler = await state.ready_for(body.model)  # another local model is loaded on first use
    check_request(body, state.limits, engine.config.sampling.max_tokens, engine.context_window)
    plan = await asyncio.to_thread(to_engine, body, engine)  # templating + tokenizing off the event loop
    job = scheduler.submit([Run(p, q) for p, q in zip(plan.prompts, plan.params)], asyncio.get_running_loop())
    return engine, plan, job


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    return await _route(request, body, chat=True)


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest) -> Response:
    return await _route(request, body, chat=False)


async def _route(request: Request, body: Union[ChatCompletionRequest, CompletionRequest], *, chat: bool) -> Response:
    """Through the routing policy when the server has one, else straight to the local engine."""
    state = request.app.state.edgellm
    try:
        tags = request_markers(request, body.metadata)
    except APIError as exc:
        return exc.response()
    if state.policy is None:
        return await _serve(request, body, chat=chat)
    try:
        state.check_model(body.model)
        routed = RoutedServe(request, await request.json(), chat, state.policy, state.power_mode,
                             lambda timeout_s: _serve(request, body, chat=chat, timeout_s=timeout_s), tags)
        return await routed.run()
    except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
        return to_api_error(exc).response()


async def _collect(job: Job, request: Request, body: Union[ChatCompletionRequest, CompletionRequest],
                   plan: EngineRequest, choices: list[R.Choice], *, chat: bool) -> Response | None:
    """Gather the job's chunks into `choices`; an error event's response (or fallback answer) if one comes."""
    async for event in _events(job, request):
        if event.kind == "error":
            return _failed(request, body, _engine_error(event, plan), chat=chat)
        if event.kind == "chunk" and event.chunk is not None:
            choices[event.index].add(event.chunk)
    return None


async def _serve(request: Request, body: Union[ChatCompletionRequest, CompletionRequest], *, chat: bool,
                 timeout_s: float | None = None) -> Response:
    """The local engine's answer; with `timeout_s`, LocalTimeout when the reply (or a stream's first token) is late."""
    try:
        engine, plan, job = await _submit(request, body)
    except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
        return _failed(request, body, to_api_error(exc), chat=chat)
    try:
        if body.stream:
            return await _stream(request, body, engine, plan, job, chat=chat, timeout_s=timeout_s)
        choices = [R.Choice(i) for i in range(len(plan.prompts))]
        collect = _collect(job, request, body, plan, choices, chat=chat)
        try:
            failed = await (collect if timeout_s is None else asyncio.wait_for(collect, timeout_s))
        except asyncio.TimeoutError:
            job.cancel()
            raise LocalTimeout() from None
        if failed is not None:
            return failed
        rid = R.new_id("chatcmpl" if chat else "cmpl")
        name = request.app.state.edgellm.model_name
        if chat:
            want = bool(body.logprobs)
            out = R.chat_completion(rid, name, choices, plan.tool_names, engine.tokenizer, want, body.n)
        else:
            out = R.text_completion(rid, name, choices, engine.tokenizer, body.logprobs is not None, body.n)
        return JSONResponse(out)
    except ClientGone:
        return Response(status_code=499)
    except LocalTimeout:
        raise
    except Exception as exc:  # noqa: BLE001
        job.cancel()
        return to_api_error(exc).response()


async def _stream(request: Request, body: Union[ChatCompletionRequest, CompletionRequest], engine: Engine,
                  plan: EngineRequest, job: Job, *, chat: bool, timeout_s: float | None = None) -> Response:
    """Wait for the first event (so errors at request start get their status), then stream SSE chunks."""
    events = _events(job, request)
    first = await wait_first(events, timeout_s, job.cancel)
    if first.kind == "error":
        return _failed(request, body, _engine_error(first, plan), chat=chat)
    writer: _ChatWriter | _TextWriter
    if isinstance(body, ChatCompletionRequest):  # (`chat` says the same)
        writer = _ChatWriter(request, body, engine, plan)
    else:
        writer = _TextWriter(request, body, engine)

    async def generate() -> AsyncIterator[bytes]:
        try:
            event: Event | None = first
            rest = _events(job, None)  # the response has started: Starlette now watches for the disconnect
            while event is not None:
                if event.kind == "error":
                    yield R.sse(_engine_error(event, plan).body())
                    return
                if event.kind == "end":
                    for data in writer.finish():
                        yield R.sse(data)
                    yield R.sse("[DONE]")
                    return
                for data in writer.chunk(event):
                    yield R.sse(data)
                event = await rest.__anext__()
        except Exception as exc:  # noqa: BLE001 - the headers are sent: the error goes out as the last event
            yield R.sse(to_api_error(exc).body())
        finally:
            job.cancel()  # a no-op once the job is done; frees the engine at once if the client went away

    return StreamingResponse(generate(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Writer(ABC):
    """Turns engine events into chunk bodies for one streamed response."""

    obj = ""

    def __init__(self, request: Request, body: Union[ChatCompletionRequest, CompletionRequest], engine: Engine) -> None:
        self.rid = R.new_id("chatcmpl" if self.obj.startswith("chat") else "cmpl")
        self.model = request.app.state.edgellm.model_name
        self.created = R.now()
        self.tokenizer = engine.tokenizer
        self.with_usage = body.include_usage()
        self.n = body.n
        self.stats: list[Any] = []

    @abstractmethod
    def chunk(self, event: Event) -> list[dict[str, Any]]:
        """The chunk bodies for one engine event."""

    def finish(self) -> list[dict[str, Any]]:
        return [R.usage_chunk(self.rid, self.model, self.created, self.obj, self.stats, self.n)] \
            if self.with_usage else []


class _ChatWriter(_Writer):
    obj = "chat.completion.chunk"

    def __init__(self, request: Request, body: ChatCompletionRequest, engine: Engine, plan: EngineRequest) -> None:
        super().__init__(request, body, engine)
        self.want_logprobs = body.logprobs
        self.tool_names = plan.tool_names
        self.started: set[int] = set()
        self.buffered: dict[int, R.Choice] = {}  # with tools, a reply is read whole: it may be a tool call

    def _make(self, index: int, delta: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return R.chat_chunk(self.rid, self.model, self.created, index, delta, with_usage=self.with_usage, **kw)

    def chunk(self, event: Event) -> list[dict[str, Any]]:
        chunk, i = event.chunk, event.index
        assert chunk is not None
        out = []
        if i not in self.started:
            self.started.add(i)
            out.append(self._make(i, {"role": "assistant", "content": ""}))
        if self.tool_names:
            self.buffered.setdefault(i, R.Choice(i)).add(chunk)
        elif chunk.text or chunk.logprobs:
            lp = R.chat_logprobs(chunk.logprobs, self.tokenizer) if self.want_logprobs else None
            out.append(self._make(i, {"content": chunk.text}, logprobs=lp))
        if chunk.finish_reason is not None:
            if chunk.stats is not None:
                self.stats.append(chunk.stats)
            finish = chunk.finish_reason
            if self.tool_names:
                message, finish = R.chat_message(self.buffered.pop(i), self.tool_names)
                if message.get("tool_calls"):
                    calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                    out.append(self._make(i, {"tool_calls": calls}))
                elif message["content"]:
                    out.append(self._make(i, {"content": message["content"]}))
            out.append(self._make(i, {}, finish=finish))
        return out


class _TextWriter(_Writer):
    obj = "text_completion"

    def __init__(self, request: Request, body: CompletionRequest, engine: Engine) -> None:
        super().__init__(request, body, engine)
        self.want_logprobs = body.logprobs is not None

    def chunk(self, event: Event) -> list[dict[str, Any]]:
        chunk = event.chunk
        assert chunk is not None
        out = []
        if chunk.text or chunk.logprobs:
            lp = R.completion_logprobs(chunk.logprobs, self.tokenizer) if self.want_logprobs else None
            out.append(R.text_chunk(self.rid, self.model, self.created, event.index, chunk.text, logprobs=lp,
                                    with_usage=self.with_usage))
        if chunk.finish_reason is not None:
            if chunk.stats is not None:
                self.stats.append(chunk.stats)
            out.append(R.text_chunk(self.rid, self.model, self.created, event.index, "",
                                    finish=chunk.finish_reason, with_usage=self.with_usage))
        return out
