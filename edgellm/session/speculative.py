"""Speculative decoding by prompt lookup: draft tokens from n-gram matches in the prompt and the output so far (no
draft model), verified against the model's own next-token distributions. (A draft model's drafts:
session/speculative_draft.py; both are Drafters of the session's one verification loop.)

Drafting, one token at a time: the token that followed the longest n-gram ending the history and the draft so far,
at its latest earlier occurrence in the history (n from `max_ngram` down to 1: extraction and editing copy spans of
their input, which this finds) or, where that n-gram is longer and was always followed by the same token, in the
model's earlier replies (ReplyMemory, n up to MEMORY_NGRAM: what a model's replies share across requests — the layout
of its JSON, a task's phrasing — which the prompt does not spell); as many as the drafter's current length: it starts
at START_DRAFT, grows by one after a draft kept whole (up to `max_draft`) and after a refused one becomes what was
kept plus one. A batched verification costs more rows for a longer draft (the step computes all of them), so a draft
should be about as long as what tends to be kept (docs/server.md#speculative-decoding).

Under an output constraint (a JSON schema, a regex, a grammar) the draft also holds the text the grammar forces next,
spelled in the tokenizer's tokens (keys, separators, the rest of an enum value: nearly always kept, so outside that
length, up to `max_draft` in all), and lookup's tokens only as far as the grammar allows them; the lookup continues
from the history with the draft so far. It works on a copy of the constraint's state (ConstraintFork).

Verifying (session/generation_session.py): the sampled token and the draft are fed to the model, each draft
token is checked against the distribution at its position, and the first one refused ends the draft: its place is
taken by a token drawn from what is left of the distribution, and the positions fed after it are rolled back.

The acceptance rule is standard speculative sampling with a point-mass draft: a drafted token d is kept with
probability p(d) (p: the request's filtered distribution at that position), else the token is drawn from p without
d, renormalized; the kept-or-drawn token is distributed exactly as p. Greedy: d is kept iff it is the argmax, and
the argmax replaces it otherwise, so the output is the plain greedy output token for token.

Each verified position's logits are computed as a decode step computes them, so the output is byte-identical to plain
decoding: on the native decoder all the positions in one batched step (`step_rows`: NativeModel.decode_batch over rows
sharing the cache, the weights read once for the token and its whole draft, each row's logits those of the step
alone), elsewhere one step per position, only as far as the draft is kept (the native prefill computes several
positions at once, but with other arithmetic: docs/server.md#speculative-decoding).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator, NamedTuple, Protocol, Sequence

import numpy as np

from edgellm.errors import EdgeLLMError
from edgellm.generation import ConstraintFork
from edgellm.kernels.decoder import NativeDecoder
from edgellm.session.sampling import categorical, filter_logits

METHODS = ("lookup", "draft:MODEL")
DRAFT_PREFIX = "draft:"
MAX_DRAFT = 8
MAX_NGRAM = 3
START_DRAFT = 2
MEMORY_NGRAM = 4
MEMORY_ENTRIES = 65_536  # n-grams a ReplyMemory holds (about 16k reply tokens; docs/server.md: its size)


class Drafter(Protocol):
    """What the session's speculative loop drafts with: prompt lookup (LookupDrafter) or a draft model
    (session/speculative_draft.py's DraftRunner)."""

    forced: int  # tokens of the latest draft that the output constraint forced

    def extend(self, tokens: Sequence[int]) -> None: ...

    def propose(self, limit: int) -> list[int]: ...

    def accept(self, logits: np.ndarray, index: int, drafted: int, generator: np.random.Generator) -> int: ...

    def rebase(self, history: Sequence[int]) -> None: ...


def check_method(method: str) -> str:
    """`method` itself if it names a speculative method ("lookup", or "draft:MODEL": session/speculative_draft.py);
    EdgeLLMError naming the known ones otherwise."""
    if method != "lookup" and not (method.startswith(DRAFT_PREFIX) and method[len(DRAFT_PREFIX):].strip()):
        raise EdgeLLMError(f"unknown speculative decoding {method!r}; known: {', '.join(METHODS)}")
    return method


def draft_model_name(method: str) -> str | None:
    """MODEL of a checked "draft:MODEL" method (None for lookup)."""
    return method[len(DRAFT_PREFIX):].strip() if method.startswith(DRAFT_PREFIX) else None


class DraftLength:
    """The draft length both drafters adapt to what is kept (prompt lookup here, a draft model in
    session/speculative_draft.py): it starts at `start`, grows by one after a draft kept whole (up to `most`) and
    after a refused one becomes what was kept plus one."""

    def _reset_length(self, start: int, most: int) -> None:
        self.max_draft = most
        self.length = min(start, most)  # tokens the next draft may hold
        self._draft: list[int] = []  # the latest draft, checked against the tokens appended since
        self._kept = 0  # of it, those the appended tokens matched so far
        self.forced = 0  # of it, tokens an output constraint forced (prompt lookup's drafts only)

    def _check_draft(self, token: int) -> None:
        """Compare an appended token with the latest draft, and adapt the length."""
        if not self._draft:
            return
        if token == self._draft[self._kept]:
            self._kept += 1
            if self._kept < len(self._draft):
                return
            self.length = min(self.max_draft, self.length + 1)
        else:
            self.length = self._kept + 1
        self._draft = []


class Recalled(NamedTuple):
    """What a ReplyMemory holds after an n-gram: the token that followed it last, and whether every reply that held
    the n-gram followed it with that token."""

    n: int
    token: int
    consistent: bool


class ReplyMemory:
    """The token that followed each 1- to `max_ngram`-gram in one model's earlier replies (the latest, and whether it
    always was that one), for prompt lookup to draft from: shared by the engine's sessions, bounded (the n-gram seen
    longest ago goes first past `entries`), held in this process's memory only (never written, never logged). Replies
    add under a lock; drafters read without one (single dictionary reads)."""

    def __init__(self, *, max_ngram: int = MEMORY_NGRAM, entries: int = MEMORY_ENTRIES) -> None:
        self.max_ngram = max_ngram
        self.entries = entries
        self._next: OrderedDict[tuple[int, ...], tuple[int, bool]] = OrderedDict()  # n-gram → (token, consistent)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._next)

    def add(self, reply: Sequence[int]) -> None:
        """Remember what followed each n-gram of a finished reply."""
        tokens = [int(t) for t in reply]
        with self._lock:
            for i in range(1, len(tokens)):
                for n in range(1, min(self.max_ngram, i) + 1):
                    key = tuple(tokens[i - n : i])
                    seen = self._next.get(key)
                    self._next[key] = (tokens[i], seen is None or (seen[1] and seen[0] == tokens[i]))
                    self._next.move_to_end(key)
            while len(self._next) > self.entries:
                self._next.popitem(last=False)

    def match(self, tail: Sequence[int]) -> Recalled | None:
        """The longest n-gram ending `tail` that an earlier reply held, and what followed it; None if not even the
        last token was seen."""
        for n in range(min(self.max_ngram, len(tail)), 0, -1):
            seen = self._next.get(tuple(tail[-n:]))
            if seen is not None:
                return Recalled(n, *seen)
        return None


class LookupDrafter(DraftLength):
    """Prompt-lookup drafts over a growing token history and, with `memory`, the model's earlier replies, their length
    adapted to what is kept; `sampling`: the request's, for the acceptance rule. `remember` gives the memory the
    tokens appended since the drafter was made (the reply)."""

    def __init__(self, history: Sequence[int], *, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_DRAFT,
                 sampling: dict[str, Any] | None = None,
                 constraint: Callable[[], ConstraintFork | None] | None = None,
                 memory: ReplyMemory | None = None) -> None:
        self.history: list[int] = []
        self.max_ngram = max_ngram
        self.memory = memory
        self._tail = max(max_ngram, memory.max_ngram if memory is not None else 0)  # the history lookup reads
        self._reset_length(START_DRAFT, max_draft)
        self._follower: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]  # by n: n-gram → next
        self.sampling: dict[str, Any] = sampling or {"temperature": 0.0}
        self.constraint = constraint  # the output constraint's state after the output so far, copied (or None)
        self.extend(history)
        self._reply_from = len(self.history)

    def remember(self) -> None:
        """The reply so far joins the memory (nothing without one)."""
        if self.memory is not None:
            self.memory.add(self.history[self._reply_from :])

    def accept(self, logits: np.ndarray, index: int, drafted: int, generator: np.random.Generator) -> int:
        """The token at a drafted position (accept_draft under the request's sampling)."""
        return accept_draft(logits, drafted, generator, **self.sampling)

    def rebase(self, history: Sequence[int]) -> None:
        """The sequence was shifted: the n-grams of the whole history so far still draft well (nothing changes)."""

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; every n-gram now followed by a token points at that token's position (the latest wins)."""
        h = self.history
        for token in tokens:
            self._check_draft(int(token))
            i = len(h)
            h.append(int(token))
            for n in range(1, min(self.max_ngram, i) + 1):
                self._follower[n][tuple(h[i - n : i])] = i

    def propose(self, limit: int) -> list[int]:
        """At most `limit` tokens: up to `length` that followed the longest n-gram matching the history's end and,
        under an output constraint, only those it allows, with the tokens it forces put in where they come (those
        outside `length`, up to `max_draft` in all). The tokens appended next are checked against the draft (see
        length)."""
        fork = self.constraint() if self.constraint is not None else None
        self._draft, self._kept, self.forced = [], 0, 0
        count = min(limit, self.length)
        tail = self.history[-self._tail :]  # all the n-gram lookup reads of the history
        if fork is None:
            self._draft = self._follow(tail, count)
            return list(self._draft)
        draft = self._draft
        room, looked = min(limit, self.max_draft), 0
        while len(draft) < room:
            forced = fork.forced_tokens()[: room - len(draft)]
            taken = 0
            while taken < len(forced) and fork.accept_token(forced[taken]):
                taken += 1  # a tokenizer that spells the text otherwise (a prefix space) stops here
            draft += forced[:taken]
            self.forced += taken
            if forced and taken == len(forced):
                continue
            if taken or looked >= count:
                break
            tokens = self._follow(tail + draft, min(count - looked, room - len(draft)))
            allowed = 0
            while allowed < len(tokens) and fork.accept_token(tokens[allowed]):
                allowed += 1
            draft += tokens[:allowed]
            looked += allowed
            if allowed == 0 or allowed < len(tokens):
                break  # no match, or the constraint refuses what follows: the rest of it is not drafted
        return list(draft)

    def _follow(self, tail: Sequence[int], count: int) -> list[int]:
        """At most `count` tokens, each the one that followed the longest n-gram ending `tail` (the history's end, or
        the history and a draft after it) and the tokens drafted before it: see _next_token."""
        span = list(tail[-self._tail :])
        tokens: list[int] = []
        while len(tokens) < count:
            token = self._next_token(span)
            if token is None:
                break
            tokens.append(token)
            span = span[1:] + [token] if len(span) >= self._tail else span + [token]
        return tokens

    def _next_token(self, tail: Sequence[int]) -> int | None:
        """The token after the longest n-gram ending `tail` at its latest earlier occurrence in the history, unless
        the memory holds a longer one that earlier replies always followed with the same token; the memory's token
        also where the history has no match at all."""
        found = self.memory.match(tail) if self.memory is not None else None
        for n in range(min(self.max_ngram, len(tail)), 0, -1):
            if found is not None and found.consistent and found.n > n:
                break
            start = self._follower[n].get(tuple(tail[-n:]))
            if start is not None:
                return self.history[start]
        return found.token if found is not None else None


def accept_draft(logits: np.ndarray, draft: int, generator: np.random.Generator, *, temperature: float,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> int:
    """The token at a drafted position: `draft` kept with probability p(draft) under the request's filtered
    distribution p (temperature 0: iff it is the argmax), else a token drawn from p without `draft`."""
    if temperature == 0.0:
        return int(logits.argmax())
    scores, ids = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    where = np.flatnonzero(ids == draft) if ids is not None else np.array([draft])
    if where.size:
        weights = np.exp(scores - scores.max(), dtype=np.float64)
        if generator.random() * weights.sum() < weights[where[0]]:
            return draft
        scores = scores.copy()
        scores[where[0]] = -np.inf
    choice = categorical(scores, generator)
    return choice if ids is None else int(ids[choice])


def step_rows(model: Any, ids: Sequence[int], start: int, cache: Any) -> Iterator[np.ndarray]:
    """The logits after each of `ids` at positions start.., each as a decode step computes it: with a native batched
    step (a model whose decoder is a NativeDecoder and that has decode_batch), up to its max_batch rows per call,
    the next call only when the caller reads past them; else one step each, computed only as far as the caller reads
    (a refused draft token's followers are never fed)."""
    native = getattr(model, "native", None)
    if isinstance(native, NativeDecoder) and hasattr(model, "decode_batch"):
        for s in range(0, len(ids), native.max_batch):
            chunk = [int(t) for t in ids[s : s + native.max_batch]]
            yield from model.decode_batch(chunk, range(start + s, start + s + len(chunk)), [cache] * len(chunk))
        return
    for i, token in enumerate(ids):
        yield model.run([int(token)], start + i, cache)
