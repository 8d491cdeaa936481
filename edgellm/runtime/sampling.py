"""Token sampling: small pure filters and logits processors, composed by factories (mlx-lm style).

Filters follow Hugging Face semantics, applied in the order temperature -> top-k -> top-p -> min-p. After the
first filter the distribution is kept as a short list of candidates (logits, token ids), so a decode step never
sorts the whole vocabulary when top-k is set, nor in the usual case when only top-p is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from edgellm.errors import EdgeLLMError

Sampler = Callable[[Tensor, torch.Generator | None], int]
LogitsProcessor = Callable[[Sequence[int], Tensor], Tensor]  # (token ids, logits (V,)) -> logits
RequestProcessor = Callable[[Sequence[int], Sequence[int], Tensor], Tensor]  # (prompt ids, generated ids, logits)

# Top-p alone first looks for the nucleus among this many highest logits; only a wider one needs a sort.
_NUCLEUS_HEAD = 256


class SamplingParameterError(EdgeLLMError, ValueError):
    """A sampling or penalty parameter outside its valid range."""


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise SamplingParameterError(f"{field} must be {rule}, got {value!r}")


def apply_top_k(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k highest logits in descending order and their token ids."""
    return torch.topk(logits, min(k, logits.numel()))


def apply_top_p(logits: Tensor, ids: Tensor | None, top_p: float) -> tuple[Tensor, Tensor]:
    """Keep the smallest highest-probability prefix whose mass reaches top_p (HF `TopPLogitsWarper`).

    `ids` is None for the full vocabulary (unsorted logits), else the token ids of logits sorted descending.
    Returns the kept logits (descending) and their token ids. Masses are summed in float64 so that the cut is exact
    even when the nucleus holds thousands of tokens.
    """
    top = logits.max()
    total = torch.exp(logits - top).sum(dtype=torch.float64)
    if ids is None:
        logits, ids = _nucleus_candidates(logits, top, total, top_p)
    probs = torch.exp((logits - top).double()) / total
    # A token survives while the mass strictly above it is below top_p; the first always survives.
    keep = int(((torch.cumsum(probs, 0) - probs) < top_p).sum())
    return logits[:keep], ids[:keep]


def _nucleus_candidates(logits: Tensor, top: Tensor, total: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """A descending prefix of the vocabulary that contains the top-p nucleus, found without a full sort if possible."""
    head, head_ids = torch.topk(logits, min(_NUCLEUS_HEAD, logits.numel()))
    if torch.exp((head - top).double()).sum() / total >= top_p:
        return head, head_ids
    # Tokens with probability below (1 - top_p) / V hold less than 1 - top_p together, so none is in the nucleus
    # (the bound is halved to stay clear of rounding).
    floor = math.log((1.0 - top_p) / (2 * logits.numel()) * float(total))
    ids = torch.nonzero(logits - top >= floor).squeeze(1)
    values, order = torch.sort(logits[ids], descending=True)
    return values, ids[order]


def apply_min_p(logits: Tensor, ids: Tensor | None, min_p: float) -> tuple[Tensor, Tensor]:
    """Keep tokens whose probability is at least min_p times the top one (HF `MinPLogitsWarper`)."""
    keep = logits >= logits.max() + math.log(min_p)
    if ids is None:
        ids = torch.nonzero(keep).squeeze(1)
        return logits[ids], ids
    return logits[keep], ids[keep]


def categorical(logits: Tensor, generator: torch.Generator | None = None) -> int:
    """Draw an index from softmax(logits) by inverse CDF on one uniform from `generator`.

    Equivalent to `torch.multinomial(softmax(logits), 1)` in distribution, and about 20x faster on a 150k vocab.
    """
    cdf = torch.cumsum(torch.softmax(logits, 0), 0)
    u = torch.rand(1, generator=generator, dtype=cdf.dtype) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), logits.numel() - 1)


def filter_logits(
    logits: Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[Tensor, Tensor | None]:
    """Temperature-scale and filter `logits` (V,); returns (candidate logits, their token ids or None for all V)."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    ids: Tensor | None = None
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

        def greedy(logits: Tensor, generator: torch.Generator | None = None) -> int:
            if logits.dtype == torch.float32 and logits.device.type == "cpu":  # numpy's: ~4 µs vs torch's ~60 µs
                return int(logits.detach().numpy().argmax())  # on a 49k vocab; same first-maximum rule
            return int(torch.argmax(logits))

        return greedy

    def sample(logits: Tensor, generator: torch.Generator | None = None) -> int:
        scores, ids = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        choice = categorical(scores, generator)
        return choice if ids is None else int(ids[choice])

    return sample


def repetition_penalty(penalty: float) -> LogitsProcessor:
    """HF/CTRL repetition penalty over `token_ids` (prompt + generated): divide positive logits, multiply negative."""
    _check(penalty > 0.0 and math.isfinite(penalty), "repetition_penalty", "> 0", penalty)

    def process(token_ids: Sequence[int], logits: Tensor) -> Tensor:
        if len(token_ids) == 0:
            return logits
        return _penalize(logits, torch.as_tensor(token_ids, dtype=torch.long), penalty)

    return process


def _penalize(logits: Tensor, ids: Tensor, penalty: float) -> Tensor:
    """A copy of `logits` with the tokens `ids` (repeats allowed) penalized: positive / penalty, negative * penalty."""
    seen = logits.gather(0, ids)
    return logits.scatter(0, ids, torch.where(seen < 0, seen * penalty, seen / penalty))


def presence_frequency_penalty(presence: float, frequency: float) -> LogitsProcessor:
    """OpenAI penalties over `token_ids` = generated tokens only: logit -= count * frequency + (count > 0) * presence."""
    _check(-2.0 <= presence <= 2.0, "presence_penalty", "in [-2, 2]", presence)
    _check(-2.0 <= frequency <= 2.0, "frequency_penalty", "in [-2, 2]", frequency)

    def process(token_ids: Sequence[int], logits: Tensor) -> Tensor:
        if len(token_ids) == 0:
            return logits
        ids, counts = torch.unique(torch.as_tensor(token_ids, dtype=torch.long), return_counts=True)
        penalty = counts.to(logits.dtype) * frequency + presence
        return logits.index_add(0, ids, -penalty)

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
    ids = torch.tensor(list(entries), dtype=torch.long)
    values = torch.tensor(list(entries.values()), dtype=torch.float32)
    top = max(entries, default=-1)

    def process(token_ids: Sequence[int], logits: Tensor) -> Tensor:
        if top >= logits.numel():
            raise SamplingParameterError(f"logit_bias token id {top} is outside the vocabulary ({logits.numel()})")
        return logits.index_add(0, ids, values.to(logits.dtype))

    return process


class _RepetitionOverRequest:
    """The repetition penalty over one request's prompt + generated ids, which it keeps as a tensor of the
    distinct ids seen so far: the prompt is read once and each step adds only the new tokens (the whole
    history was turned into a tensor on every step before: ~0.2 ms per token at 600 tokens). Any other
    call (another prompt, a generated list that is not the last one extended) starts over."""

    def __init__(self, penalty: float) -> None:
        _check(penalty > 0.0 and math.isfinite(penalty), "repetition_penalty", "> 0", penalty)
        self.penalty = penalty
        self._start(None)

    def _start(self, prompt: Sequence[int] | None) -> None:
        self.prompt, self.done = prompt, 0
        self.seen: dict[int, None] = dict.fromkeys(prompt or ())  # distinct ids, in the order first seen
        self.ids = torch.tensor(list(self.seen), dtype=torch.long)

    def __call__(self, prompt: Sequence[int], generated: Sequence[int], logits: Tensor) -> Tensor:
        if prompt is not self.prompt or len(generated) < self.done:
            self._start(prompt)
        fresh = list(dict.fromkeys(t for t in generated[self.done :] if t not in self.seen))
        self.done = len(generated)
        if fresh:  # appended: the tensor keeps the order first seen without being rebuilt from every id
            self.seen.update(dict.fromkeys(fresh))
            self.ids = torch.cat([self.ids, torch.tensor(fresh, dtype=torch.long)])
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
