"""Loop guard, repeating periods: the open string, number or array ends in a repeat (or a runaway digit run).

A loop is: the value's text ends in at least `min_repeats` copies of a period of at most `max_period` characters,
covering at least `min_chars`; for a string, `masked_repeats` copies once its digit runs are masked (counting
loops); or a run of more than `max_digit_run` digits (`max_number_digits` in a number). Every allowed token that
would continue it loses `penalty * base**k` (k counting the interventions inside this value); once the loop
persists (`close_after` interventions, or a second loop in the same value, `close_episodes`) the tokens that close
the value are lifted above every other allowed token. A value the guard already steered counts a loop from two
copies; a string copying one it steered (`copies.Relapses`) is closed at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from edgellm.loop_guard_config import LoopGuardConfig
from edgellm.structured.loop_guard.copies import Relapses
from edgellm.structured.loop_guard.scanner import JSONScanner, TokenTexts, mask_digits
from edgellm.structured.loop_guard.string_close import StringCloser


@dataclass(frozen=True)
class Loop:
    """A repetition at the end of `text`: `period` characters repeated (None for a digit run)."""

    kind: str  # "string" | "number" | "array"
    text: str
    period: int | None
    start: int = 0  # where the looping value starts in the generated text (identifies it across steps)
    masked: bool = False  # the period repeats in the text with its digit runs masked (`mask_digits`)


def _period(text: str, longest: int, repeats: int, min_chars: int) -> int | None:
    """The shortest period (up to `longest`) that the end of `text` repeats `repeats` times over `min_chars`."""
    n = len(text)
    if n < min_chars:
        return None
    for period in range(1, min(longest, n // repeats) + 1):
        i = n - 1 - period
        while i >= 0 and text[i] == text[i + period]:
            i -= 1
        covered = n - 1 - i  # characters at the end that have this period
        if covered >= max(repeats * period, min_chars):
            return period
    return None


def find_loop(kind: str, text: str, cfg: LoopGuardConfig) -> Loop | None:
    """The repetition `text` ends in, if it is long enough to count as a loop."""
    text = text[-cfg.window:]
    if kind == "array":
        period = _period(text, cfg.max_array_period, cfg.min_repeats, cfg.min_array_chars)
        return Loop(kind, text, period) if period is not None else None
    period = _period(text, cfg.max_period, cfg.min_repeats, cfg.min_chars)
    if period is not None:
        return Loop(kind, text, period)
    run = len(text) - len(text.rstrip("0123456789"))
    if run > (cfg.max_number_digits if kind == "number" else cfg.max_digit_run):
        return Loop(kind, text, None)
    if kind == "string":
        period = _period(mask_digits(text), cfg.max_period, cfg.masked_repeats, cfg.min_chars)
        if period is not None:
            return Loop(kind, text, period, masked=True)
    return None


def continues(loop: Loop, piece: str) -> bool:
    """Would appending `piece` extend the loop? (Every character repeats the period, or is another digit.)"""
    if not piece:
        return False
    if loop.period is None:
        return piece.isdigit()
    before, text = loop.text, loop.text + piece
    if loop.masked:
        before, text = mask_digits(before), mask_digits(text)
        if text == before:
            return True  # more digits of the run the text ends in
        start = len(before) - 1 if before.endswith("#") and piece[0].isdigit() else len(before)
    else:
        start = len(before)
    return all(text[i] == text[i - loop.period] for i in range(start, len(text)))


class RepeatingPeriods:
    """Penalizes continuing a loop at the end of the open value and closes the value once the loop persists."""

    def __init__(self, table: TokenTexts, cfg: LoopGuardConfig, relapses: Relapses) -> None:
        self.cfg = cfg
        self._table = table
        self._relapses = relapses  # what the guard steered, to catch copies of it
        self._value_id: tuple[str, int] = ("", -1)
        self._in_value = 0  # interventions inside the current value
        self._episodes = 0  # loops the current value fell into (a step without a loop between two)
        self._looping = False  # the previous step found a loop
        self.closer: StringCloser | None = None  # a string the grammar does not let close yet (`LoopGuard.attach`)
        # a value the guard already steered is watched closer: a loop it falls back into counts from two copies
        self._relapse = replace(cfg, min_repeats=2, masked_repeats=2)
        self.steps = 0  # steps whose logits it changed
        self.closed = 0  # steps where it lifted the closing tokens

    def steer(self, scanner: JSONScanner, logits: np.ndarray) -> np.ndarray | None:
        """A copy of `logits` with the tokens that continue a detected loop penalized; None when it changes none."""
        if self._relapses.string_copy(scanner) and self._value_id != ("string", scanner.value_start):
            # a string copying one the guard already steered: closed at once, as a loop that persisted
            self._value_id, self._in_value = ("string", scanner.value_start), self.cfg.close_after
        loop = next((replace(found, start=start) for kind, text, start in scanner.segments()
                     if (found := find_loop(kind, text, self._thresholds(kind, start))) is not None), None)
        if loop is None:
            self._looping = False
            if self._in_value >= self.cfg.close_after and self._still_open(scanner):
                # a value that looped persistently and still is open: keep preferring to close it
                logits = logits.copy()
                if self._close(scanner.value_kind or self._value_id[0], logits):
                    return self._acted(scanner, logits)
            return None
        if (loop.kind, loop.start) != self._value_id:  # escalation counts per looping value (an array: all items)
            self._value_id, self._in_value, self._episodes = (loop.kind, loop.start), 0, 0
        if not self._looping:
            self._episodes += 1
            if self._episodes >= self.cfg.close_episodes:  # the value loops again: the loop persists
                self._in_value = max(self._in_value, self.cfg.close_after)
        self._looping = True
        logits = logits.copy()  # the caller's logits are never changed in place
        changed = self._penalize(loop, logits)
        if self._in_value >= self.cfg.close_after:  # close what is innermost: a string inside a looping array first
            changed = self._close(scanner.value_kind or loop.kind, logits) or changed
        if not changed:
            return None
        self._in_value += 1
        return self._acted(scanner, logits)

    def _acted(self, scanner: JSONScanner, logits: np.ndarray) -> np.ndarray:
        """Count a step it changed, and remember where (and the string it steered) for `Relapses`."""
        self.steps += 1
        in_string = scanner.value_kind == "string"
        self._relapses.note(len(scanner.text), scanner.value_start if in_string else None,
                            scanner.text[scanner.value_start:] if in_string else "")
        return logits

    def _thresholds(self, kind: str, start: int) -> LoopGuardConfig:
        return self._relapse if self._in_value and (kind, start) == self._value_id else self.cfg

    def _still_open(self, scanner: JSONScanner) -> bool:
        kind, start = self._value_id
        if kind == "array":
            return ("[", start) in scanner.stack
        return scanner.value_kind == kind and scanner.value_start == start

    def _penalize(self, loop: Loop, logits: np.ndarray) -> bool:
        allowed = int(np.isfinite(logits).sum())
        if allowed <= 1:
            return False
        k = min(self.cfg.candidates, allowed)
        top = np.argpartition(logits, -k)[-k:].tolist()  # the k largest, in no particular order
        hits = [t for t in top if continues(loop, self._table.text(t))]
        if not hits or len(hits) == allowed:
            return False  # nothing to steer to: the grammar allows only the loop
        amount = self.cfg.penalty * self.cfg.base ** min(self._in_value, 60)
        logits[np.array(hits)] -= amount
        return True

    def _close(self, kind: str, logits: np.ndarray) -> bool:
        ids = self._table.closers[kind]
        ids = ids[ids < logits.shape[-1]]
        if ids.size == 0:
            return False
        values = logits[ids]
        ok = np.isfinite(values)
        if not bool(ok.any()):  # the grammar does not allow closing here (a pattern, minLength)
            return kind == "string" and self.closer is not None and self.closer.steer(logits)
        best = float(values[ok].max())
        top = float(logits.max())
        if best >= top:
            return False
        logits[ids[ok]] += top - best + 1.0
        self.closed += 1
        return True
