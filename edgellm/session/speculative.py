"""Speculative decoding by prompt lookup: draft tokens from n-gram matches in the prompt and the output so far (no
draft model), verified against the model's own next-token distributions.

Drafting: the tokens that followed the latest earlier occurrence of the history's last n tokens (n from
`max_ngram` down to 1), at most `max_draft` of them — extraction and editing copy spans of their input, which this
finds. Verifying (session/generation_session.py): the sampled token and the draft are fed to the model, each draft
token is checked against the distribution at its position, and the first one refused ends the draft: its place is
taken by a token drawn from what is left of the distribution, and the positions fed after it are rolled back.

The acceptance rule is standard speculative sampling with a point-mass draft: a drafted token d is kept with
probability p(d) (p: the request's filtered distribution at that position), else the token is drawn from p without
d, renormalized; the kept-or-drawn token is distributed exactly as p. Greedy: d is kept iff it is the argmax, and
the argmax replaces it otherwise, so the output is the plain greedy output token for token.

Each verified position's logits are computed as a decode step computes them (`step_rows`: one step per position, only
as far as the draft is kept), so the output is byte-identical to plain decoding; the speed-up needs a forward that
reads the weights once for all the positions with the step's arithmetic (the batched decode step; the native prefill
computes several positions at once, but with other arithmetic: docs/server.md#speculative-decoding).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from edgellm.errors import EdgeLLMError
from edgellm.session.sampling import categorical, filter_logits

METHODS = ("lookup",)
MAX_DRAFT = 8
MAX_NGRAM = 3


def check_method(method: str) -> str:
    """`method` itself if it names a speculative method; EdgeLLMError naming the known ones otherwise."""
    if method not in METHODS:
        raise EdgeLLMError(f"unknown speculative decoding {method!r}; known: {', '.join(METHODS)}")
    return method


class LookupDrafter:
    """Prompt-lookup drafts over a growing token history."""

    def __init__(self, history: Sequence[int], *, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_DRAFT) -> None:
        self.history: list[int] = []
        self.max_ngram = max_ngram
        self.max_draft = max_draft
        self._follower: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]  # by n: n-gram → next
        self.extend(history)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; every n-gram now followed by a token points at that token's position (the latest wins)."""
        h = self.history
        for token in tokens:
            i = len(h)
            h.append(int(token))
            for n in range(1, min(self.max_ngram, i) + 1):
                self._follower[n][tuple(h[i - n : i])] = i

    def propose(self, limit: int) -> list[int]:
        """At most min(limit, max_draft) tokens that followed the longest n-gram matching the history's end."""
        h = self.history
        count = min(limit, self.max_draft)
        if count <= 0:
            return []
        for n in range(min(self.max_ngram, len(h)), 0, -1):
            start = self._follower[n].get(tuple(h[-n:]))
            if start is not None:
                return h[start : start + count]
        return []


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
    """The logits after each of `ids` at positions start.., one decode step each, computed only as far as the
    caller reads (a refused draft token's followers are never fed)."""
    for i, token in enumerate(ids):
        yield model.run([int(token)], start + i, cache)
