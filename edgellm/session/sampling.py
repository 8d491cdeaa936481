"""Token sampling: small pure filters and logits processors, composed by factories (mlx-lm style).

Everything works on numpy arrays, so that the inference process need not import torch (whose import alone costs
~218 MiB of RSS): logits are a 1-D float32 `np.ndarray` (V,) and the random source is a `np.random.Generator`.

Filters follow Hugging Face semantics, applied in the order temperature -> top-k -> top-p -> min-p. After the
first filter the distribution is kept as a short list of candidates (logits, token ids), so a decode step never
sorts the whole vocabulary when top-k is set, nor in the usual case when only top-p is.

Ties: candidates are ordered by logit, highest first, equal logits by lower token id; where a cut (top-k, top-p)
falls inside a run of equal logits, the lower token ids are the ones kept.

Processors return a new array and never modify the logits they are given (with nothing to do, they may return
the input itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from edgellm.errors import EdgeLLMError

Sampler = Callable[[np.ndarray, np.random.Generator | None], int]
LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]  # (token ids, logits (V,)) -> logits
RequestProcessor = Callable[[Sequence[int], Sequence[int], np.ndarray], np.ndarray]  # (prompt, generated, logits)

# Top-p alone first looks for the nucleus among this many highest logits; only a wider one needs a sort.
_NUCLEUS_HEAD = 256
# categorical() sums the weights of blocks of this many tokens, then accumulates only inside the chosen block.
_CDF_BLOCK = 1024


class SamplingParameterError(EdgeLLMError, ValueError):
    """A sampling or penalty parameter outside its valid range."""


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise SamplingParameterError(f"{field} must be {rule}, got {value!r}")


def _descending(values: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`values` and their token `ids` (ascending) reordered by value, highest first, equal values by lower id."""
    order = np.argsort(-values)  # quicksort: a stable sort takes ~7x longer on 20k candidates
    ranked = values[order]
    first = np.empty(ranked.size, dtype=bool)  # where each run of equal values starts
    first[:1] = True
    np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
    if not first.all():  # ties, in whatever order quicksort left them: sort each run by position (= by id)
        key = np.cumsum(first) * ranked.size + order
        key.sort()
        order = key % ranked.size
    return values[order], ids[order]


def apply_top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k highest logits in descending order and their token ids (equal logits: lower id first and kept).

    A partition of the values finds the k-th highest (no sort of the vocabulary, no (V,) index array); only the
    k survivors are sorted.
    """
    n = logits.size
    if k <= 0:
        return logits[:0], np.empty(0, dtype=np.intp)
    if k >= n:
        return _descending(logits, np.arange(n))
    kth = np.partition(logits, n - k)[n - k]
    ids = np.flatnonzero(logits >= kth)
    if ids.size > k:  # tokens tied with the k-th highest beyond the k: keep those of lower id
        tied = np.flatnonzero(logits[ids] == kth)
        ids = np.delete(ids, tied[k - (ids.size - tied.size) :])
    return _descending(logits[ids], ids)


def apply_top_p(logits: np.ndarray, ids: np.ndarray | None, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep the smallest highest-probability prefix whose mass reaches top_p (HF `TopPLogitsWarper`).

    `ids` is None for the full vocabulary (unsorted logits), else the token ids of logits sorted descending.
    Returns the kept logits (descending) and their token ids. Masses are summed in float64 so that the cut is exact
    even when the nucleus holds thousands of tokens.
    """
    top = logits.max()
    total = float(np.exp(logits - top).sum(dtype=np.float64))
    if ids is None:
        logits, ids = _nucleus_candidates(logits, top, total, top_p)
    probs = np.exp((logits - top).astype(np.float64)) / total
    # A token survives while the mass strictly above it is below top_p; the first always survives.
    keep = int(np.count_nonzero((np.cumsum(probs) - probs) < top_p))
    return logits[:keep], ids[:keep]


def _nucleus_candidates(
    logits: np.ndarray, top: np.floating, total: float, top_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """A descending prefix of the vocabulary that contains the top-p nucleus, found without a full sort if possible."""
    head, head_ids = apply_top_k(logits, _NUCLEUS_HEAD)
    if np.exp((head - top).astype(np.float64)).sum() / total >= top_p:
        return head, head_ids
    # Tokens with probability below (1 - top_p) / V hold less than 1 - top_p together, so none is in the nucleus
    # (the bound is halved to stay clear of rounding).
    floor = math.log((1.0 - top_p) / (2 * logits.size) * total)
    ids = np.flatnonzero(logits - top >= floor)
    return _descending(logits[ids], ids)


def apply_min_p(logits: np.ndarray, ids: np.ndarray | None, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep tokens whose probability is at least min_p times the top one (HF `MinPLogitsWarper`)."""
    keep = logits >= logits.max() + math.log(min_p)
    if ids is None:
        ids = np.flatnonzero(keep)
        return logits[ids], ids
    return logits[keep], ids[keep]


def categorical(logits: np.ndarray, generator: np.random.Generator | None = None) -> int:
    """Draw an index from softmax(logits) by inverse CDF on one uniform `generator.random()` (None: a fresh
    `np.random.default_rng()`).

    The weights exp(logit - max) are float32, their cumulative sums float64; the index is the first whose
    cumulative weight exceeds u * total (`searchsorted(side="right")`), so a token of probability 0 is never drawn.
    Over more than a few blocks the cumulative sum is two-level: block totals, then the running sum inside the
    chosen block only (a float64 cumsum of the whole vocabulary costs ~0.45 ms at 150k; this ~0.1 ms). The two
    differ only in float64 rounding of the running sum.
    """
    rng = np.random.default_rng() if generator is None else generator
    weights = np.exp(logits - logits.max())
    n = weights.size
    if n <= 4 * _CDF_BLOCK:
        cdf = np.cumsum(weights, dtype=np.float64)
        return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), n - 1)
    whole = n - n % _CDF_BLOCK
    sums = weights[:whole].reshape(-1, _CDF_BLOCK).sum(axis=1, dtype=np.float64)
    if whole < n:
        sums = np.append(sums, weights[whole:].sum(dtype=np.float64))
    blocks = np.cumsum(sums)
    u = rng.random() * blocks[-1]
    b = min(int(np.searchsorted(blocks, u, side="right")), blocks.size - 1)
    start = b * _CDF_BLOCK
    cdf = np.cumsum(weights[start : start + _CDF_BLOCK], dtype=np.float64)
    i = int(np.searchsorted(cdf, u - (blocks[b - 1] if b else 0.0), side="right"))
    if i == cdf.size:  # rounding of the block total put u past this block's sum: its last token of nonzero weight
        i = int(np.searchsorted(cdf, cdf[-1], side="left"))
    return start + i


def filter_logits(
    logits: np.ndarray, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[np.ndarray, np.ndarray | None]:
    """Temperature-scale and filter `logits` (V,); returns (candidate logits, their token ids or None for all V)."""
    scores = np.asarray(logits, dtype=np.float32)
    if temperature != 1.0:
        scores = scores / np.float32(temperature)
    ids: np.ndarray | None = None
    if top_k > 0:
        scores, ids = apply_top_k(scores, top_k)
    if top_p < 1.0:
        scores, ids = apply_top_p(scores, ids, top_p)
    if min_p > 0.0:
        scores, ids = apply_min_p(scores, ids, min_p)
    return scores, ids


def make_sampler(temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """A sampler `(logits (V,), generator | None) -> token id`; temperature 0 is greedy (argmax, filters ignored)."""
    _check(temperature >= 0.0 and math.isfinite(temperature), "temperature", ">= 0", temperature)
    _check(0.0 < top_p <= 1.0, "top_p", "in (0, 1]", top_p)
    _check(isinstance(top_k, int) and top_k >= 0, "top_k", "an integer >= 0", top_k)
    _check(0.0 <= min_p <= 1.0, "min_p", "in [0, 1]", min_p)

    if temperature == 0.0:

        def greedy(logits: np.ndarray, generator: np.random.Generator | None = None) -> int:
            return int(logits.argmax())  # the first maximum

        return greedy

    def sample(logits: np.ndarray, generator: np.random.Generator | None = None) -> int:
        scores, ids = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        choice = categorical(scores, generator)
        return choice if ids is None else int(ids[choice])

    return sample


def _token_ids(token_ids: Iterable[int]) -> np.ndarray:
    """Token ids as an index array; a negative id is an error (numpy would silently count it from the end)."""
    ids = np.asarray(token_ids, dtype=np.intp)
    if ids.size and ids.min() < 0:
        raise IndexError(f"token id {int(ids.min())} is outside the vocabulary")
    return ids


def repetition_penalty(penalty: float) -> LogitsProcessor:
    """HF/CTRL repetition penalty over `token_ids` (prompt + generated): divide positive logits, multiply negative."""
    _check(penalty > 0.0 and math.isfinite(penalty), "repetition_penalty", "> 0", penalty)

    def process(token_ids: Sequence[int], logits: np.ndarray) -> np.ndarray:
        if len(token_ids) == 0:
            return logits
        return _penalize(logits, _token_ids(token_ids), penalty)

    return process


def _penalize(logits: np.ndarray, ids: np.ndarray, penalty: float) -> np.ndarray:
    """A copy of `logits` with the tokens `ids` (repeats allowed) penalized: positive / penalty, negative * penalty."""
    seen = logits[ids]
    out = logits.copy()
    out[ids] = np.where(seen < 0, seen * penalty, seen / penalty)
    return out


def presence_frequency_penalty(presence: float, frequency: float) -> LogitsProcessor:
    """OpenAI penalties over `token_ids` = generated tokens only: logit -= count * frequency + (count > 0) * presence."""
    _check(-2.0 <= presence <= 2.0, "presence_penalty", "in [-2, 2]", presence)
    _check(-2.0 <= frequency <= 2.0, "frequency_penalty", "in [-2, 2]", frequency)

    def process(token_ids: Sequence[int], logits: np.ndarray) -> np.ndarray:
        if len(token_ids) == 0:
            return logits
        ids, counts = np.unique(_token_ids(token_ids), return_counts=True)
        out = logits.copy()
        out[ids] -= counts.astype(logits.dtype) * frequency + presence
        return out

    return process


def logit_bias(bias: Mapping[int, float]) -> LogitsProcessor:
    """OpenAI logit bias: add bias[token] (in [-100, 100]) to that token's logit; keys may be ints or digit strings."""
    try:
        entries = {int(token): float(value) for token, value in bias.items()}
    except (TypeError, ValueError):
        raise SamplingParameterError(f"logit_bias must map token ids to numbers, got {dict(bias)!r}") from None
    for token, value in entries.items():
        _check(token >= 0, "logit_bias token id", ">= 0", token)
        _check(-100.0 <= value <= 100.0, f"logit_bias[{token}]", "in [-100, 100]", value)
    top = max(entries, default=-1)
    indexable = top < 2**62  # else no vocabulary holds `top`, and process() says so before these are used
    ids = np.array(list(entries) if indexable else [], dtype=np.intp)
    values = np.array(list(entries.values()) if indexable else [], dtype=np.float32)

    def process(token_ids: Sequence[int], logits: np.ndarray) -> np.ndarray:
        if top >= logits.size:
            raise SamplingParameterError(f"logit_bias token id {top} is outside the vocabulary ({logits.size})")
        out = logits.copy()
        out[ids] += values.astype(logits.dtype, copy=False)
        return out

    return process


class _RepetitionOverRequest:
    """The repetition penalty over one request's prompt + generated ids, which it keeps as an array of the
    distinct ids seen so far: the prompt is read once and each step adds only the new tokens (the whole
    history was turned into an index array on every step before: ~0.2 ms per token at 600 tokens). Any other
    call (another prompt, a generated list that is not the last one extended) starts over."""

    def __init__(self, penalty: float) -> None:
        _check(penalty > 0.0 and math.isfinite(penalty), "repetition_penalty", "> 0", penalty)
        self.penalty = penalty
        self._start(None)

    def _start(self, prompt: Sequence[int] | None) -> None:
        self.prompt, self.done = prompt, 0
        self.seen: dict[int, None] = dict.fromkeys(prompt or ())  # distinct ids, in the order first seen
        self.ids = _token_ids(list(self.seen))

    def __call__(self, prompt: Sequence[int], generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
        if prompt is not self.prompt or len(generated) < self.done:
            self._start(prompt)
        fresh = list(dict.fromkeys(t for t in generated[self.done :] if t not in self.seen))
        if fresh:  # appended: the array keeps the order first seen without being rebuilt from every id
            self.ids = np.concatenate([self.ids, _token_ids(fresh)])
            self.seen.update(dict.fromkeys(fresh))
        self.done = len(generated)
        return _penalize(logits, self.ids, self.penalty) if self.seen else logits


# make_logits_processors' keyword arguments (the OpenAI field names) shadow this factory.
_logit_bias = logit_bias


def make_logits_processors(
    *,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
) -> list[RequestProcessor]:
    """The enabled processors for one request, in order bias -> repetition -> presence/frequency.

    Each is called as `processor(prompt_ids, generated_ids, logits)`: the repetition penalty sees both, the
    presence/frequency penalty only the generated ids.
    """
    processors: list[RequestProcessor] = []
    if logit_bias:
        bias = _logit_bias(logit_bias)
        processors.append(lambda prompt, generated, logits: bias(generated, logits))
    if repetition_penalty != 1.0:
        processors.append(_RepetitionOverRequest(repetition_penalty))
    if presence_penalty != 0.0 or frequency_penalty != 0.0:
        penalize = presence_frequency_penalty(presence_penalty, frequency_penalty)
        processors.append(lambda prompt, generated, logits: penalize(generated, logits))
    return processors
