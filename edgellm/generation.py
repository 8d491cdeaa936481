"""Engine-side request and result types (the server converts its wire types to these at its edge)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Protocol, Sequence

from edgellm.loop_guard_config import DEFAULT_LOOP_GUARD, LoopGuardConfig
from edgellm.response_format import ResponseFormat

if TYPE_CHECKING:
    import numpy as np
    import torch

# (generated token ids so far, logits (V,) float32 torch tensor) -> logits; e.g. a grammar mask. A request that
# has one imports torch; its logits share the engine's numpy array's memory (session/generation_session.py).
LogitsProcessor = Callable[[Sequence[int], "torch.Tensor"], "torch.Tensor"]
# The same on the float32 numpy logits themselves: an output constraint's, which must not cost a torch import.
ArrayLogitsProcessor = Callable[[Sequence[int], "np.ndarray"], "np.ndarray"]


@dataclass(frozen=True)
class GenerationParams:
    """Sampling and stopping for one request; None means the artifact's default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logits_processors: tuple[LogitsProcessor, ...] = ()
    top_logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only
    response_format: ResponseFormat | None = None  # structured output (JSON, schema, grammar, regex)
    context_shift: str | None = None  # at a full window: None stops ("length"); "reencode" or "rope" shift
    context_keep: int = 4  # tokens kept at the start through a shift (a chat passes its system prompt's length)
    loop_guard: LoopGuardConfig | None = DEFAULT_LOOP_GUARD  # JSON modes: steer out of degenerate loops; None: off
    budget_finish: bool = False  # JSON modes: near max_tokens, steer to the shortest valid close (budget_closed)
    # Prefix reuse: "auto" is "exact" for greedy or seeded requests (the same bits as an empty cache: only whole
    # fresh prefill chunks are reused) and "any" otherwise (every matching cached token, decode steps included).
    prefix_reuse: Literal["auto", "exact", "any"] = "auto"
    speculative: str | None = None  # "lookup": prompt-lookup drafts, verified (session/speculative.py); None: off


@dataclass
class GenerationStats:
    """Per-request timings and counts, the figures a user feels (P1, P4)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused from the previous request
    completion_tokens: int = 0
    tokenize_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # request start → first token sampled
    decode_s: float = 0.0  # first token → last token
    total_s: float = 0.0
    context_shifts: int = 0  # times the full window dropped its oldest tokens (session/context.py)
    shift_s: float = 0.0  # time those shifts took
    paced_s: float = 0.0  # pauses the power mode added (session/power.py)
    hot_tokens: int = 0  # tokens slowed down because the device was above the mode's temperature threshold
    temperature_c: float | None = None  # the hottest sensor reading seen, where the platform exposes one
    guard_interventions: int = 0  # steps where the loop guard changed the logits (0 without a JSON constraint)
    grammar_s: float = 0.0  # preparing the request's grammar constraint (import, compile or cache load), before TTFT
    draft_tokens: int = 0  # speculative decoding: tokens drafted (session/speculative.py) ...
    accepted_tokens: int = 0  # ... and kept by the acceptance rule
    forced_draft_tokens: int = 0  # of the drafted tokens, those the output constraint forced (prompt lookup only)

    @property
    def acceptance_rate(self) -> float | None:
        """Drafted tokens kept, of those drafted (None without a draft)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def prefill_tokens_per_s(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1  # the first token comes out of prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | None]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "tokenize_s": round(self.tokenize_s, 6),
            "prefill_s": round(self.prefill_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "decode_s": round(self.decode_s, 6),
            "total_s": round(self.total_s, 6),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "context_shifts": self.context_shifts,
            "shift_s": round(self.shift_s, 6),
            "paced_s": round(self.paced_s, 6),
            "hot_tokens": self.hot_tokens,
            "temperature_c": self.temperature_c,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "forced_draft_tokens": self.forced_draft_tokens,
        }


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StreamChunk:
    """One piece of a streamed response; the last chunk carries finish_reason and stats."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS / stop string) or "length" (max_tokens / context full)
    stats: GenerationStats | None = None
    complete: bool | None = None  # final chunk, constrained output: did the grammar reach an accepting end?
    unenforced: tuple[str, ...] = ()  # best-effort mode: schema keywords that were not enforced
    narrowed: tuple[str, ...] = ()  # "keyword at /pointer: how": where the grammar accepts less than the schema
    budget_closed: bool = False  # budget_finish steered the JSON to a valid close at max_tokens (complete is False)


@dataclass
class GenerationResult:
    """A finished generation, collected from the stream."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] = field(default_factory=list)
    complete: bool | None = None  # constrained output only: False when truncated (never valid JSON then)
    unenforced: tuple[str, ...] = ()
    narrowed: tuple[str, ...] = ()  # where the grammar accepts less than the schema (still valid when complete)
    fallback: bool = False  # the text is a caller's rule-based answer, not the model's (runtime/rule_answer.py)
    fallback_reason: str | None = None
    budget_closed: bool = False  # parseable JSON closed early because max_tokens was near; complete is False


@dataclass(frozen=True)
class ConstraintReport:
    """What a constraint says of the output it shaped, for the final chunk: the finish reason as it stands (it
    may turn "stop" into "length"), and the fields of StreamChunk it owns."""

    finish_reason: str
    complete: bool | None = None
    unenforced: tuple[str, ...] = ()
    narrowed: tuple[str, ...] = ()
    budget_closed: bool = False
    guard_interventions: int = 0


class ConstraintFork(Protocol):
    """A copy of an output constraint's state after the tokens accepted so far, which a drafter advances on its
    own (the constraint itself moves only with the output): the tokens it forces next, and whether it takes one."""

    def forced_tokens(self) -> list[int]:
        """Tokens that must come next (the grammar allows one continuation); [] where there is a choice."""
        ...

    def accept_token(self, token: int) -> bool:
        """Advance by `token`; False (and unchanged) where the constraint forbids it."""
        ...


class Constraint(Protocol):
    """What the engine's token loop asks of an output constraint (structured/processor.py's GrammarConstraint)."""

    stop_token_ids: frozenset[int]  # tokens that end the output, beside the request's own
    prepare_s: float  # time spent preparing it before the request started (reported as grammar_s)
    finished: bool  # only an end can follow the tokens accepted so far: no step need sample it

    def logits_processors(self) -> tuple[ArrayLogitsProcessor, ...]:
        """Its processors, to run on the numpy logits after the request's own."""
        ...

    def accept(self, token: int) -> bool:
        """Take the sampled token; False when it breaks the constraint (the output ends before it)."""
        ...

    def fork(self) -> ConstraintFork | None:
        """A copy of its state for drafting (None where it cannot constrain the next token: ended or rejected)."""
        ...

    def report(self, finish_reason: str, *, stop_string: bool) -> ConstraintReport:
        """Its part of the final chunk, the output having ended for `finish_reason` (`stop_string`: on a stop
        string of the request)."""
        ...


class Unconstrained:
    """The Constraint of a request without one: accepts every token, reports nothing."""

    stop_token_ids: frozenset[int] = frozenset()
    prepare_s = 0.0
    finished = False

    def logits_processors(self) -> tuple[ArrayLogitsProcessor, ...]:
        return ()

    def accept(self, token: int) -> bool:
        return True

    def fork(self) -> ConstraintFork | None:
        return None

    def report(self, finish_reason: str, *, stop_string: bool) -> ConstraintReport:
        return ConstraintReport(finish_reason)
