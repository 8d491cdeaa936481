"""Speculative decoding with a draft model: a smaller model with the target's tokenizer proposes tokens from its own
KV cache, and the target verifies the fed token and the whole draft in one batched step (session/speculative.py's
step_rows, as prompt lookup does).

The acceptance rule is standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): a drafted token d,
drawn from the draft's filtered distribution q, is kept with probability min(1, p(d) / q(d)), p the target's filtered
distribution at that position; else the token is drawn from the normalized residual max(0, p − q). The kept-or-drawn
token is distributed exactly as p. Greedy: the draft proposes its argmax and d is kept iff it is the target's argmax
(which replaces it otherwise), so the output is the plain greedy output token for token.

q is the draft's logits filtered by the request's temperature, top-k, top-p and min-p (not its penalties, logit bias
or constraints, which hold state of the target's tokens): any q keeps p exact, a closer one keeps more. The draft's
cache follows the target's tokens: before each draft it drops what follows the longest prefix it shares with them
(a refused token and the drafts after it) and feeds the rest.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from edgellm.models.kv_space import KVSpace
from edgellm.session.sampling import filter_logits
from edgellm.session.speculative import DraftLength, step_rows

MAX_DRAFT = 8
START_DRAFT = 3


def probabilities(logits: np.ndarray, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> np.ndarray:
    """The filtered distribution over the whole vocabulary (float64 (V,), zero outside the kept candidates)."""
    scores, ids = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    weights = np.exp(scores.astype(np.float64) - float(scores.max()))
    weights /= weights.sum()
    if ids is None:
        return weights
    out = np.zeros(logits.size, dtype=np.float64)
    out[ids] = weights
    return out


def draw(probs: np.ndarray, generator: np.random.Generator) -> int:
    """An index drawn from `probs` (nonnegative, not all zero) by inverse CDF on one uniform; never one of weight 0."""
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, generator.random() * cdf[-1], side="right")), probs.size - 1)


def accept_drafted(p: np.ndarray, q: np.ndarray, drafted: int, generator: np.random.Generator) -> int:
    """The token at a drafted position: `drafted` (drawn from q) kept with probability min(1, p/q), else a token drawn
    from max(0, p − q) normalized (p, q: float64 distributions over the same vocabulary)."""
    if generator.random() * q[drafted] < p[drafted]:
        return drafted
    residual = np.maximum(p - q, 0.0)
    return draw(residual if residual.sum() > 0 else p, generator)


class DraftModel:
    """A loaded draft model (runtime/draft.py loads one) shared by the sessions that draft with it: their calls take
    turns on its lock (a server's slots draft from their own threads)."""

    def __init__(self, name: str, model: Any, *, kv_cache: str, window: int, prefill_chunk: int) -> None:
        self.name = name  # as the request names it: draft:NAME
        self.model = model
        self.kv_cache = kv_cache
        self.window = window
        self.prefill_chunk = prefill_chunk
        self.lock = threading.Lock()

    def runner(self) -> DraftRunner:
        """A runner with a KV cache of its own, for one session."""
        return DraftRunner(self, self.model.new_cache(self.window, kind=self.kv_cache))


class DraftRunner(DraftLength):
    """One session's drafting: the draft's cache and the tokens it holds, the request's sampling, the draft length
    (DraftLength: from START_DRAFT up to MAX_DRAFT)."""

    def __init__(self, draft: DraftModel, cache: KVSpace) -> None:
        self.draft = draft
        self.cache = cache
        self.fed: list[int] = []  # tokens whose keys/values the draft's cache holds, from position 0
        self.history: list[int] = []  # the target's sequence: the prompt and the tokens output since
        self.sampling: dict[str, Any] = {"temperature": 0.0}
        self.generator: np.random.Generator | None = None
        self.vocab = 0  # the target's logits length
        self._reset_length(START_DRAFT, MAX_DRAFT)
        self._q: list[np.ndarray] = []  # the distribution each drafted token was drawn from (sampled requests)

    @property
    def name(self) -> str:
        return self.draft.name

    def begin(self, ids: Sequence[int], sampling: dict[str, Any], generator: np.random.Generator, *,
              exact: bool, reserve: int, vocab: int) -> None:
        """A new request: its prompt `ids` prefilled into the draft's cache (reusing the prefix it shares with the
        last request's tokens, unless `exact`: then from an empty cache, so a seeded request's drafts repeat),
        room for `reserve` positions; `vocab`: the length of the target's logits."""
        self.vocab = vocab
        self.history = [int(t) for t in ids]
        self.sampling = dict(sampling)
        self.generator = generator
        self._reset_length(START_DRAFT, MAX_DRAFT)
        self._q = []
        if exact:
            self.fed = []
        self.cache.reserve(min(self.draft.window, reserve))
        self._sync(chunked=True)

    def rebase(self, history: Sequence[int]) -> None:
        """The target's sequence changed other than by appending (a context shift): it is now `history`."""
        self.history = [int(t) for t in history]
        self._draft = []

    def extend(self, tokens: Sequence[int]) -> None:
        """Append the target's output tokens; each is checked against the latest draft (the draft length)."""
        for token in tokens:
            self._check_draft(int(token))
            self.history.append(int(token))

    def _sync(self, *, chunked: bool) -> np.ndarray:
        """Feed the history into the draft's cache past the prefix it already holds (at least the last token, so its
        logits come back): in prefill chunks (a prompt, a shifted context) or as decode-step rows (the tokens output
        since: one batched step, each row's logits those of its decode step alone, as the target's verification
        computes them); the logits after the history's last token."""
        h = self.history
        n = 0
        for a, b in zip(self.fed, h):
            if a != b:
                break
            n += 1
        n = min(n, len(h) - 1)
        del self.fed[n:]  # what follows the shared prefix: a refused token, drafts after it
        logits = None
        with self.draft.lock:
            if chunked or len(h) - n > MAX_DRAFT + 1:  # a prompt, or the tokens after a context shift
                for s in range(n, len(h), self.draft.prefill_chunk):
                    part = h[s : s + self.draft.prefill_chunk]
                    logits = self.draft.model.run(part, s, self.cache)
                    self.fed.extend(part)
            else:  # one batched step for them all (the last drafted token and the target's next, say)
                for logits in step_rows(self.draft.model, h[n:], n, self.cache):
                    pass
                self.fed.extend(h[n:])
        assert logits is not None
        return logits

    def propose(self, limit: int) -> list[int]:
        """At most min(limit, length) tokens drafted after the history: each the draft's argmax (greedy) or drawn
        from its filtered distribution, the draft's cache fed with each but the last."""
        count = min(limit, self.length)
        self._draft, self._kept, self._q = [], 0, []
        if count <= 0:
            return []
        logits = self._sync(chunked=False)
        vocab = self.vocab
        greedy = self.sampling["temperature"] == 0.0
        draft: list[int] = []
        for j in range(count):
            logits = _fit(logits, vocab)
            if greedy:
                token = int(logits.argmax())
            else:
                assert self.generator is not None
                q = probabilities(logits, **self.sampling)
                token = draw(q, self.generator)
                self._q.append(q)
            draft.append(token)
            if j + 1 < count:
                with self.draft.lock:
                    logits = self.draft.model.run([token], len(self.fed), self.cache)
                self.fed.append(token)
        self._draft = draft
        return list(draft)

    def accept(self, logits: np.ndarray, index: int, drafted: int, generator: np.random.Generator) -> int:
        """The token at the latest draft's position `index` under the target's processed `logits`."""
        if self.sampling["temperature"] == 0.0:
            return int(logits.argmax())
        return accept_drafted(probabilities(logits, **self.sampling), self._q[index], drafted, generator)


def _fit(logits: np.ndarray, vocab: int) -> np.ndarray:
    """The draft's logits over the target's `vocab` ids: cut, or padded with -inf (never drafted)."""
    if logits.size == vocab:
        return logits
    if logits.size > vocab:
        return logits[:vocab]
    return np.concatenate([logits, np.full(vocab - logits.size, -np.inf, dtype=logits.dtype)])
