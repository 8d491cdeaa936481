"""The grammar constraint on the engine's generation stream: a logits processor plus a matcher fed every token."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from edgellm.errors import SchemaError, StructuredOutputError
from edgellm.generation import ArrayLogitsProcessor, ConstraintFork, ConstraintReport
from edgellm.structured.budget_finish import BudgetFinish
from edgellm.structured.loop_guard import LoopGuard, token_texts
from edgellm.structured.pattern_bound import check_grammar_format, check_regex_format
from edgellm.structured.xgrammar_core import Matcher, apply_bitmask, bitmask_words, core

if TYPE_CHECKING:  # xgrammar's core loads only when a request is constrained
    from edgellm.generation import GenerationParams
    from edgellm.tokenizer import Tokenizer
    from edgellm.structured.grammar import CompiledFormat


MAX_FORCED_CHARS = 64  # of the text a grammar forces, what a draft may spell (a draft holds at most 8 tokens)


class GrammarFork:
    """A copy of a constraint's matcher that a drafter advances on its own (generation.ConstraintFork): the forced
    text spelled in the tokenizer's own tokens (the model writes those, not necessarily xgrammar's greedy split)."""

    def __init__(self, matcher: Matcher, encode: Callable[[str], list[int]]) -> None:
        self._matcher = matcher
        self._encode = encode

    def forced_tokens(self) -> list[int]:
        if self._matcher.is_terminated():  # a drafted stop token ended it
            return []
        text = self._matcher.forced_text()[:MAX_FORCED_CHARS]
        return self._encode(text) if text else []

    def accept_token(self, token: int) -> bool:
        return not self._matcher.is_terminated() and self._matcher.accept_token(token)


class GrammarConstraint:
    """Masks every token the grammar forbids (EOS too, until the grammar accepts) and tracks completion.

    A Constraint (edgellm/generation.py): the engine runs `process` on each step's numpy logits, after every other
    logits processor,
    calls `accept` with each sampled token and takes its `report` for the final chunk. `finished` turns True as soon
    as the grammar can only end, so no decode step is spent sampling the forced EOS.
    """

    def __init__(self, compiled: CompiledFormat, vocab_size: int, stop_token_ids: Iterable[int], *,
                 guard: LoopGuard | None = None, budget: BudgetFinish | None = None,
                 encode: Callable[[str], list[int]] | None = None) -> None:
        self.guard = guard  # steers out of loops, after the mask, among the allowed tokens only
        self.encode = encode  # the tokenizer's, without BOS: drafts spell forced text with it (none: no drafts)
        self.budget = budget
        self.stop_token_ids = frozenset(stop_token_ids)
        self.unenforced = compiled.unenforced
        self.narrowed = compiled.narrowed
        self._matcher = core().matcher(compiled.grammar, sorted(self.stop_token_ids))
        for part in (guard, budget):  # both may steer a string the grammar does not let close yet
            if part is not None:
                part.attach(compiled.patterns, self._matcher.fork)
        self._vocab_size = vocab_size
        self._bitmask = bitmask_words(vocab_size)
        self._words = self._bitmask.view(np.uint32)
        stop_bits: dict[int, int] = {}  # bitmask word -> its stop tokens' bits (several stops may share a word)
        for t in self.stop_token_ids:
            if t < vocab_size:
                stop_bits[t >> 5] = stop_bits.get(t >> 5, 0) | 1 << (t & 31)
        self._stop_words = np.array(list(stop_bits), dtype=np.int64)
        self._stop_bits = np.array(list(stop_bits.values()), dtype=np.uint32)
        self._filled = False  # the bitmask already holds the mask for the next step
        self.rejected = False
        self.finished = False
        self.prepare_s = 0.0  # time build_constraint took: xgrammar's core loaded on first use, the compile
        self.mask_s = 0.0  # time spent computing and applying masks and advancing the matcher
        self.guard_s = 0.0  # time spent in the loop guard and the budget finish
        self.steps = 0

    def process(self, generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
        """Set the logits of forbidden tokens to -inf, in place (padding ids beyond the tokenizer included)."""
        t0 = time.perf_counter()
        if not self._filled and not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(self._bitmask)
            if not self._words.any():  # sampling from all -inf logits would fail (or pick a forbidden token)
                raise StructuredOutputError("no token of this model's vocabulary can continue the constrained "
                                            "output: the format cannot be generated with this tokenizer")
        self._filled = False
        apply_bitmask(logits, self._bitmask, self._vocab_size)
        t1 = time.perf_counter()
        self.mask_s += t1 - t0
        self.steps += 1
        if self.guard is not None:
            logits = self.guard.process(generated, logits)
        if self.budget is not None:
            logits = self.budget.process(generated, logits)
        self.guard_s += time.perf_counter() - t1
        return logits

    def accept(self, token: int) -> bool:
        """Advance the matcher by the sampled token; False when the grammar rejects it (the output must end)."""
        t0 = time.perf_counter()
        if self.rejected or not self._matcher.accept_token(token):
            self.rejected = True
            self.mask_s += time.perf_counter() - t0
            return False
        if token not in self.stop_token_ids and self._matcher.is_completed():
            self._matcher.fill_next_token_bitmask(self._bitmask)
            self._filled = True
            words = self._words.copy()
            words[self._stop_words] &= ~self._stop_bits
            self.finished = not words.any()  # nothing but a stop token may follow
        self.mask_s += time.perf_counter() - t0
        return True

    def fork(self) -> ConstraintFork | None:
        """A copy of the matcher after the tokens accepted so far, for drafting (session/speculative.py); None once
        the output is rejected or ended."""
        if self.encode is None or self.rejected or self._matcher.is_terminated():
            return None
        return GrammarFork(self._matcher.fork(), self.encode)

    @property
    def grammar_complete(self) -> bool:
        """The output so far is a whole sentence of the grammar (it ended on a stop token or can only end)."""
        return not self.rejected and (self.finished or self._matcher.is_terminated())

    @property
    def budget_closed(self) -> bool:
        """The budget finish steered the output to its end: parseable, but not finished by the model."""
        return self.budget is not None and self.budget.engaged and self.grammar_complete

    @property
    def complete(self) -> bool:
        """A whole sentence of the grammar that the model finished on its own (not closed by the budget finish)."""
        return self.grammar_complete and not self.budget_closed

    @property
    def guard_interventions(self) -> int:
        return self.guard.interventions if self.guard is not None else 0

    def logits_processors(self) -> tuple[ArrayLogitsProcessor, ...]:
        """The grammar mask (with the loop guard and the budget finish), to run after every other processor."""
        return (self.process,)

    def report(self, finish_reason: str, *, stop_string: bool) -> ConstraintReport:
        """Complete only where the output ended on the grammar's own end (not on a stop string, not closed by the
        budget finish); closed early for the budget, the output reports the length limit it was steered around."""
        budget_closed = not stop_string and self.budget_closed
        return ConstraintReport("length" if budget_closed else finish_reason,
                                complete=finish_reason == "stop" and not stop_string and self.complete,
                                unenforced=self.unenforced, narrowed=self.narrowed, budget_closed=budget_closed,
                                guard_interventions=self.guard_interventions)


def request_stop_ids(stop_token_ids: Iterable[int], params: GenerationParams) -> set[int]:
    """The stop token ids of a request: its own, plus the model's (`stop_token_ids`) unless it ignores EOS."""
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(stop_token_ids)
    return stop_ids


def build_constraint(tokenizer: Tokenizer, vocab_size: int, params: GenerationParams, *,
                     stop_token_ids: Iterable[int], threads: int, default_max_tokens: int) -> GrammarConstraint | None:
    """The constraint for `params.response_format` (None when there is none); compiles or reuses the grammar.

    `stop_token_ids` are the model's end-of-generation tokens; `default_max_tokens` the reply length when
    `params.max_tokens` is None (a budget finish counts down from it). Raises SchemaError / GrammarError for an
    unsupported or malformed format, before any token is generated.
    """
    rf = params.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "regex":
        check_regex_format(rf.regex)  # a malformed or too costly pattern is refused before xgrammar loads
    if rf.type == "grammar":
        check_grammar_format(rf.grammar)
    t0 = time.perf_counter()
    from edgellm.structured.grammar import compile_format, grammar_cache

    cache = grammar_cache(tokenizer, vocab_size, threads=threads)
    try:
        compiled = compile_format(cache, rf)
    except RecursionError:  # the checks walk the schema recursively; a server caps depth before (--max-schema-depth)
        raise SchemaError("the schema is nested too deeply to compile; flatten it or use $defs references") from None
    if compiled is None:
        return None
    # The grammar needs an end marker even when the request ignores EOS.
    stops = request_stop_ids(stop_token_ids, params) or set(tokenizer.stop_token_ids)
    guard = budget = None
    if rf.type in ("json_object", "json_schema") and (params.loop_guard is not None or params.budget_finish):
        table = token_texts(tokenizer, vocab_size)
        if params.loop_guard is not None:
            guard = LoopGuard(table, params.loop_guard)
        if params.budget_finish:
            budget = BudgetFinish(table, params.max_tokens if params.max_tokens is not None else default_max_tokens)
    constraint = GrammarConstraint(compiled, vocab_size, stops, guard=guard, budget=budget,
                                   encode=lambda text: tokenizer.encode(text, add_bos=False))
    constraint.prepare_s = time.perf_counter() - t0
    return constraint
