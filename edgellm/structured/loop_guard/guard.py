"""Loop guard for constrained JSON: detect a degenerate repetition inside the value being generated and steer out
of it with the tokens the grammar still allows.

A small model under a grammar can fall into `"1.1.1.1.1…"` or `"12345678901234567890…"` and the grammar happily
lets it run to max_tokens. The guard watches the text of the innermost open value (a string, a number, or the
items of an array) and, only when that text ends in a loop, acts on the logits *after* the grammar mask:

1. **penalize continuing the repeat** (in the spirit of DRY, but limited to the current value): every candidate
   token whose text would extend the repetition loses `penalty * base**k`, k counting the interventions inside this
   value, so a stubborn loop is overcome within a few tokens;
2. **when the loop persists** (`close_after` interventions in one value), the tokens that close the current
   string / number / array are lifted above every other allowed token.

A loop is: the value's text ends in at least `min_repeats` copies of a period of at most `max_period` characters,
covering at least `min_chars`; for a string, `masked_repeats` copies once its digit runs are masked (counting
loops); or a run of more than `max_digit_run` digits (`max_number_digits` in a number). A value the guard already
steered counts a loop from two copies, and one that falls into a loop a second time (`close_episodes`) is closed at
once. Arrays and objects whose members keep nearly repeating, with small variations no period catches, are closed by
the second rule, `members.RepeatedMembers`; values and members that copy what the guard steered, by
`copies.Relapses`; a string whose pattern forbids the closing quote is steered to its shortest close
(`string_close.StringCloser`). When no loop is detected the logits are returned untouched, so output that does not
loop is identical with the guard on or off.
Forbidden tokens stay at -inf (only finite logits are changed), so the guard can never make the grammar fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from edgellm.loop_guard_config import DEFAULT_LOOP_GUARD, LoopGuardConfig
from edgellm.structured.loop_guard.copies import Relapses
from edgellm.structured.loop_guard.members import RepeatedMembers
from edgellm.structured.loop_guard.periods import RepeatingPeriods
from edgellm.structured.loop_guard.rule import Rule
from edgellm.structured.loop_guard.scanner import JSONScanner, TokenTexts
from edgellm.structured.loop_guard.string_close import Matcher, StringCloser


class LoopGuard:
    """The guard for one request; `process(generated, logits)` runs after the grammar mask. It feeds the scanner
    and asks its rules in order (repeated members, then repeating periods); the first that acts decides the step."""

    def __init__(self, table: TokenTexts, cfg: LoopGuardConfig = DEFAULT_LOOP_GUARD) -> None:
        self.cfg = cfg
        self._table = table
        self._scanner = JSONScanner()
        self._seen = 0  # generated tokens already fed to the scanner
        relapses = Relapses(cfg.min_chars)  # what the guard steered, to catch copies of it (both rules note it)
        self._members = RepeatedMembers(table, cfg, relapses)
        self._periods = RepeatingPeriods(table, cfg, relapses)
        self._rules: tuple[Rule, ...] = (self._members, self._periods)
        self.interventions = 0  # steps whose logits the guard changed

    def attach(self, patterns: Iterable[str], fork: Callable[[], Matcher]) -> None:
        """Let the guard steer a string whose closing quote the grammar still forbids toward its shortest close:
        `patterns` of the schema, `fork` a copy of the request's grammar matcher (`string_close`)."""
        self._periods.closer = StringCloser(self._table, patterns, fork)

    def process(self, generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
        """Logits changed by the first rule that acts (a copy); `logits` itself when none does."""
        for token in generated[self._seen:]:
            self._scanner.feed(self._table.text(token))
        self._seen = len(generated)
        for rule in self._rules:
            steered = rule.steer(self._scanner, logits)
            if steered is not None:
                self.interventions += 1
                return steered
        return logits

    @property
    def closer(self) -> StringCloser | None:
        """The string closer `attach` gave the periods rule (None without a schema pattern)."""
        return self._periods.closer

    @property
    def member_steps(self) -> int:
        """Steps where the repeated-members rule steered toward closing an array/object."""
        return self._members.steps

    @property
    def closed(self) -> int:
        """Steps where the periods rule lifted the closing tokens."""
        return self._periods.closed
