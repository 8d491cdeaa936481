"""Engine results → OpenAI response bodies and stream chunks (chat and legacy completions)."""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from edgellm.generation import GenerationStats, StreamChunk, TokenLogprob
from edgellm.serve.protocol import Usage


@dataclass
class Choice:
    """One choice collected from the engine stream."""

    index: int
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    complete: bool | None = None
    unenforced: tuple[str, ...] = ()
    narrowed: tuple[str, ...] = ()
    budget_closed: bool = False

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, chunk: StreamChunk) -> None:
        self.texts.append(chunk.text)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.stats = chunk.stats
            self.complete = chunk.complete
            self.unenforced = chunk.unenforced
            self.narrowed = chunk.narrowed
            self.budget_closed = chunk.budget_closed


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(stats: Sequence[GenerationStats], n: int = 1) -> dict[str, Any]:
    """Counts summed over choices (each prompt once, though n choices share it); TTFT of the first choice."""
    prompt = sum(s.prompt_tokens for s in stats[::max(1, n)])
    completion = sum(s.completion_tokens for s in stats)
    decode_steps = sum(max(0, s.completion_tokens - 1) for s in stats)
    decode_s = sum(s.decode_s for s in stats)
    prefill_computed = sum(s.prompt_tokens - s.cached_tokens for s in stats)
    prefill_s = sum(s.prefill_s for s in stats)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": stats[0].cached_tokens if stats else 0},
        ttft_s=round(stats[0].ttft_s, 6) if stats else 0.0,
        prefill_tokens_per_s=round(prefill_computed / prefill_s, 2) if prefill_s > 0 else 0.0,
        decode_tokens_per_s=round(decode_steps / decode_s, 2) if decode_s > 0 and decode_steps else 0.0,
        total_s=round(sum(s.total_s for s in stats), 6),
        guard_interventions=sum(s.guard_interventions for s in stats),
        draft_tokens=sum(s.draft_tokens for s in stats), accepted_tokens=sum(s.accepted_tokens for s in stats),
    ).model_dump()


# ---- tool calls ------------------------------------------------------------------------------------------
_TAGS = re.compile(r"</?tool_call>")


def parse_tool_calls(text: str, names: Sequence[str]) -> list[dict[str, Any]] | None:
    """OpenAI tool_calls from a reply holding a tool-call object (or a list of them); None when it holds none.

    Only objects whose "name" is one of the offered tools and whose "arguments" (or "parameters") is an object
    count, so ordinary prose or JSON answers stay content.
    """
    from edgellm.structured.tolerant import parse_tolerant

    parsed = parse_tolerant(_TAGS.sub("", text).strip())  # also takes fenced or lenient JSON
    if not parsed.ok:
        return None
    value = parsed.value
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": item["name"], "arguments": json.dumps(arguments)}})
    return calls or None


# ---- logprobs --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _byte_of() -> dict[str, int]:
    from edgellm.convert.gguf_tokenizer import _byte_alphabet

    return {char: byte for byte, char in _byte_alphabet().items()}


class TokenTexts(Protocol):
    """What the logprobs need of a tokenizer (runtime's Tokenizer): a token's vocabulary piece and its text."""

    def id_to_token(self, token_id: int) -> str: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _token(tokenizer: TokenTexts, token_id: int) -> tuple[str, list[int]]:
    """A token's text and bytes; a token holding part of a UTF-8 character shows as `bytes:\\xNN...` (as OpenAI's)."""
    piece, byte_of = tokenizer.id_to_token(token_id), _byte_of()
    if piece and all(char in byte_of for char in piece):  # byte-level BPE vocabulary
        raw = bytes(byte_of[char] for char in piece)
    else:
        raw = tokenizer.decode([token_id]).encode("utf-8")
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def _possible(top: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The alternatives that could have been sampled: a token a grammar forbids (logprob -inf) is left out, so a
    constrained step may list fewer than top_logprobs (and -inf is not JSON)."""
    return [(tid, lp) for tid, lp in top if math.isfinite(lp)]


def chat_logprobs(items: Sequence[TokenLogprob], tokenizer: TokenTexts) -> dict[str, Any]:
    content = []
    for item in items:
        text, raw = _token(tokenizer, item.token_id)
        tops = []
        for tid, lp in _possible(item.top):
            ttext, traw = _token(tokenizer, tid)
            tops.append({"token": ttext, "logprob": lp, "bytes": traw})
        content.append({"token": text, "logprob": item.logprob, "bytes": raw, "top_logprobs": tops})
    return {"content": content, "refusal": None}


def completion_logprobs(items: Sequence[TokenLogprob], tokenizer: TokenTexts, offset: int = 0) -> dict[str, Any]:
    tokens, lps, tops, offsets = [], [], [], []
    for item in items:
        text, _ = _token(tokenizer, item.token_id)
        tokens.append(text)
        lps.append(item.logprob)
        tops.append({_token(tokenizer, tid)[0]: lp for tid, lp in _possible(item.top)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


# ---- whole responses -------------------------------------------------------------------------------------
def chat_message(choice: Choice, tool_names: Sequence[str]) -> tuple[dict[str, Any], str]:
    """The assistant message and finish_reason of a choice (a tool call when the reply is one)."""
    finish = choice.finish_reason or "stop"
    calls = parse_tool_calls(choice.text, tool_names) if tool_names else None
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls, "refusal": None}, "tool_calls"
    return {"role": "assistant", "content": choice.text, "refusal": None}, finish


def chat_completion(rid: str, model: str, choices: Sequence[Choice], tool_names: Sequence[str],
                    tokenizer: TokenTexts, want_logprobs: bool, n: int) -> dict[str, Any]:
    out = []
    for choice in choices:
        message, finish = chat_message(choice, tool_names)
        entry: dict[str, Any] = {"index": choice.index, "message": message, "finish_reason": finish,
                                 "logprobs": chat_logprobs(choice.logprobs, tokenizer) if want_logprobs else None}
        _structured_extras(entry, choice)
        out.append(entry)
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model, "choices": out,
            "usage": usage([c.stats for c in choices if c.stats is not None], n), "system_fingerprint": None}


def text_completion(rid: str, model: str, choices: Sequence[Choice], tokenizer: TokenTexts,
                    want_logprobs: bool, n: int) -> dict[str, Any]:
    out = []
    for choice in choices:
        entry: dict[str, Any] = {"index": choice.index, "text": choice.text, "finish_reason": choice.finish_reason,
                                 "logprobs": completion_logprobs(choice.logprobs, tokenizer) if want_logprobs
                                 else None}
        _structured_extras(entry, choice)
        out.append(entry)
    return {"id": rid, "object": "text_completion", "created": now(), "model": model, "choices": out,
            "usage": usage([c.stats for c in choices if c.stats is not None], n), "system_fingerprint": None}


def _structured_extras(entry: dict[str, Any], choice: Choice) -> None:
    """edgellm extensions: constrained output that was cut short, keywords not enforced (best effort), and where the
    grammar accepted less than the schema (narrowed)."""
    if choice.complete is not None:
        entry["complete"] = choice.complete
    if choice.unenforced:
        entry["unenforced"] = list(choice.unenforced)
    if choice.narrowed:
        entry["narrowed"] = list(choice.narrowed)
    if choice.budget_closed:
        entry["budget_closed"] = True


# ---- stream chunks ---------------------------------------------------------------------------------------
def _chunk(rid: str, obj: str, model: str, created: int, choices: list[dict[str, Any]],
           **extra: Any) -> dict[str, Any]:
    """The envelope every streamed chunk shares."""
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": choices, **extra}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict[str, Any], *,
               finish: str | None = None, logprobs: dict[str, Any] | None = None,
               with_usage: bool = False) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return _chunk(rid, "chat.completion.chunk", model, created, [choice], **({"usage": None} if with_usage else {}))


def text_chunk(rid: str, model: str, created: int, index: int, text: str, *, finish: str | None = None,
               logprobs: dict[str, Any] | None = None, with_usage: bool = False) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return _chunk(rid, "text_completion", model, created, [choice], **({"usage": None} if with_usage else {}))


def usage_chunk(rid: str, model: str, created: int, obj: str, stats: Sequence[GenerationStats],
                n: int) -> dict[str, Any]:
    return _chunk(rid, obj, model, created, [], usage=usage(stats, n))


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode("utf-8")
