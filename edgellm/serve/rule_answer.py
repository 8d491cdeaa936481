"""`serve --fallback module:function`: a rule-based answer, flagged in the body, when the model cannot answer.

It answers in place of a server-side failure (5xx: the model failed to load or crashed) or a request
timeout (408); a bad request (4xx) still gets its error. The body is an ordinary completion with
``"fallback": true`` and ``"fallback_reason"``; a streamed request gets it as one chunk and ``[DONE]``.
"""

from __future__ import annotations

import logging
from typing import Any, Union

from fastapi.responses import JSONResponse, Response, StreamingResponse

from edgellm.errors import EdgeLLMError
from edgellm.runtime.rule_answer import FallbackRule, answer
from edgellm.serve import responses as R
from edgellm.serve.errors import APIError
from edgellm.serve.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("edgellm.serve")


def _body(model: str, body: Union[ChatCompletionRequest, CompletionRequest], text: str, reason: str, *,
          chat: bool, stream: bool) -> dict[str, Any]:
    rid = R.new_id("chatcmpl" if chat else "cmpl")
    if chat:
        key, value = ("delta", {"role": "assistant", "content": text}) if stream else \
            ("message", {"role": "assistant", "content": text})
        choice: dict[str, Any] = {"index": 0, key: value, "finish_reason": "stop", "logprobs": None}
        obj = "chat.completion.chunk" if stream else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": R.now(), "model": model, "choices": [choice],
           "fallback": True, "fallback_reason": reason}
    if not stream:
        out["usage"] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return out


def fallback_response(rule: FallbackRule | None, model: str, body: Union[ChatCompletionRequest, CompletionRequest],
                      error: APIError, *, chat: bool) -> Response | None:
    """The rule's answer for a failed or timed-out request; None when there is no rule or the error is the client's."""
    if rule is None or not (error.status >= 500 or error.status == 408):
        return None
    request = [m.model_dump(exclude_none=True) for m in body.messages] if chat else body.prompt  # type: ignore[union-attr]
    try:
        result = answer(rule, request, error.message)
    except EdgeLLMError as exc:
        log.error("%s", exc)
        return None
    reason = result.fallback_reason or error.message
    if not body.stream:
        return JSONResponse(_body(model, body, result.text, reason, chat=chat, stream=False))
    events = [R.sse(_body(model, body, result.text, reason, chat=chat, stream=True)), R.sse("[DONE]")]

    async def once() -> Any:
        for event in events:
            yield event

    return StreamingResponse(once(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
