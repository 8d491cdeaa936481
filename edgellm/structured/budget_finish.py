"""Budget-aware finish (opt-in): when the tokens left would not close the open JSON, steer to a short valid close.

Near `max_tokens` (tokens left <= the open strings and containers + `reserve`, + the characters a string under a
`pattern` still needs before it may close), each step lifts, among the
tokens the grammar allows, the short structural/value token that leaves the least open: a closing quote or
bracket, a separator, or a minimal value (`0`, `""`, `null`, `[]`, `{}`); inside a string whose `pattern` forbids
the closing quote, the next token of its shortest close (`string_close`). Where the grammar allows none of them
(the middle of a required key) the model's own choice stands. A reply that reaches the grammar's end this way is
reported `budget_closed` (parseable, but not `complete`: the model did not finish it on its own).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from edgellm.structured.loop_guard.scanner import JSONScanner, TokenTexts
from edgellm.structured.loop_guard.string_close import Matcher, StringCloser

_CLOSING_CHARS = frozenset('"]},: 0123456789')
_SHORT_VALUES = frozenset({"null", "true", "false", "[]", "{}", '""'})
RESERVE = 8  # steps of slack for a required key or value the grammar still demands
MAX_CLOSE = 64  # a pattern's close is planned (a grammar fork per candidate) only this many steps before the budget
_candidates: weakref.WeakKeyDictionary[TokenTexts, np.ndarray] = weakref.WeakKeyDictionary()
_candidates_lock = threading.Lock()


def closing_candidates(table: TokenTexts) -> np.ndarray:
    """Ids of the short tokens made of closing/separator characters or a minimal value (found once per table:
    each request's budget finish asks)."""
    with _candidates_lock:
        found = _candidates.get(table)
        if found is None:
            found = _candidates[table] = np.array(
                [i for i, t in enumerate(table.texts)
                 if t and len(t) <= 6 and (set(t) <= _CLOSING_CHARS or t.strip() in _SHORT_VALUES)], dtype=np.int64)
        return found


def open_after(scanner: JSONScanner, piece: str) -> int:
    """How many strings/containers would still be open after `piece` (the scanner is left unchanged)."""
    depth, in_string = len(scanner.stack), scanner.in_string
    for _, depth, in_string in scanner.walk(piece):
        pass
    return depth + int(in_string)


class BudgetFinish:
    """Steers to a close when `max_tokens` is near; `engaged` tells whether it ever changed the logits."""

    def __init__(self, table: TokenTexts, max_tokens: int, reserve: int = RESERVE) -> None:
        self._table = table
        self._candidates = closing_candidates(table)
        self._max_tokens = max_tokens
        self._reserve = reserve
        self._scanner = JSONScanner()
        self._seen = 0
        self.closer: StringCloser | None = None  # a string the grammar does not let close yet (`attach`)
        self.engaged = False

    def attach(self, patterns: Iterable[str], fork: Callable[[], Matcher]) -> None:
        """Let it close a string under a `pattern` through its shortest completion (`string_close`)."""
        self.closer = StringCloser(self._table, patterns, fork)

    def _close_text(self, room: int) -> int:
        """Characters (at least as many as tokens) a string under a `pattern` still needs before its closing quote,
        where that many would not fit in `room` steps: its shortest close (0 outside such a string, or when the
        close is short or cannot be planned); planned only within MAX_CLOSE steps of the budget."""
        if not self._scanner.in_string or self.closer is None or room > MAX_CLOSE:
            return 0
        plan = self.closer.plan()
        return len(plan) - 1 if plan else 0  # (its closing quote is counted as the open string)

    def process(self, generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
        for token in generated[self._seen:]:
            self._scanner.feed(self._table.text(token))
        self._seen = len(generated)
        left = self._max_tokens - len(generated)  # including the token about to be chosen
        still_open = len(self._scanner.stack) + int(self._scanner.in_string)
        if still_open == 0 or left > still_open + self._reserve + self._close_text(left - still_open - self._reserve):
            return logits
        ids = self._candidates[self._candidates < logits.shape[-1]]
        values = logits[ids]
        ok = np.isfinite(values)
        best = None
        if bool(ok.any()):
            finite = zip(ids[ok].tolist(), values[ok].tolist())
            best = min(finite, key=lambda iv: (open_after(self._scanner, self._table.text(iv[0])), -iv[1]))[0]
        if self._scanner.in_string and self.closer is not None \
                and (best is None or open_after(self._scanner, self._table.text(best)) >= still_open):
            steered = logits.copy()  # no short token closes the string (a pattern): steer to its shortest close
            if self.closer.steer(steered):
                self.engaged = True
                return steered
        if best is None:
            return logits
        top = float(logits.max())
        if float(logits[best]) < top or int((logits == top).sum()) > 1:
            logits = logits.copy()  # the caller's logits are never changed in place
            logits[best] = top + 1.0
            self.engaged = True
        return logits
