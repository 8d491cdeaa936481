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
the second rule, `loop_members.RepeatedMembers`; values and members that copy what the guard steered, by
`loop_copies.Relapses`; a string whose pattern forbids the closing quote is steered to its shortest close
(`string_close.StringCloser`). When no loop is detected the logits are returned untouched, so output that does not
loop is identical with the guard on or off.
Forbidden tokens stay at -inf (only finite logits are changed), so the guard can never make the grammar fail.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from edgellm.structured.loop_copies import Relapses
from edgellm.loop_guard_config import DEFAULT_LOOP_GUARD, LoopGuardConfig  # noqa: F401 (re-exported)
from edgellm.structured.loop_members import RepeatedMembers, mask_digits
from edgellm.structured.string_close import Matcher, StringCloser

if TYPE_CHECKING:
    from edgellm.tokenizer import Tokenizer


@dataclass(frozen=True)
class Loop:
    """A repetition at the end of `text`: `period` characters repeated (None for a digit run)."""

    kind: str  # "string" | "number" | "array"
    text: str
    period: int | None
    start: int = 0  # where the looping value starts in the generated text (identifies it across steps)
    masked: bool = False  # the period repeats in the text with its digit runs masked (`mask_digits`)


class JSONScanner:
    """Follows generated JSON text character by character: open containers, and where the innermost open string or
    number (and the innermost array) started."""

    def __init__(self) -> None:
        self.text = ""
        self.stack: list[tuple[str, int]] = []  # ("{" | "[", offset just past the bracket)
        self.members: list[list[tuple[int, int]]] = []  # per open container: (start, end) of its finished members
        self._member_start: list[int] = []  # per open container: where its current member starts
        self.in_string = False
        self.escape = False
        self.value_kind: str | None = None  # "string" | "number" while one is open
        self.value_start = 0

    def feed(self, piece: str) -> None:
        start = len(self.text)
        for i, ch in enumerate(piece):
            self._char(ch, start + i)
        self.text += piece  # once per piece: the reply's text is not copied once per character

    def _char(self, ch: str, at: int) -> None:
        """Advance the state past `ch`, the text's character at offset `at`."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string, self.value_kind = False, None
            return
        if self.value_kind == "number" and not (ch.isdigit() or ch in "+-.eE"):
            self.value_kind = None
        if ch == '"':
            self.in_string, self.value_kind, self.value_start = True, "string", at + 1
        elif ch in "{[":
            self.stack.append((ch, at + 1))
            self.members.append([])
            self._member_start.append(at + 1)
        elif ch in "}]":
            if self.stack:
                self.stack.pop()
                self.members.pop()
                self._member_start.pop()
        elif ch == "," and self.stack:
            self.members[-1].append((self._member_start[-1], at))
            self._member_start[-1] = at + 1
        elif self.value_kind is None and (ch.isdigit() or ch == "-"):
            self.value_kind, self.value_start = "number", at

    def walk(self, piece: str) -> Iterator[tuple[str, int, bool]]:
        """Reads `piece` as if it followed the text, without changing the scanner: for each character, (the
        character, how many containers are open after it, whether a string is open after it)."""
        depth, in_string, escape = len(self.stack), self.in_string, self.escape
        for ch in piece:
            if in_string:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth = max(0, depth - 1)
            yield ch, depth, in_string

    def member_start(self, depth: int) -> int:
        """Where the current member of the open container `depth` levels deep (1: outermost) starts."""
        return self._member_start[depth - 1]

    def segments(self) -> list[tuple[str, str, int]]:
        """(kind, text, start) of the open value and of the innermost open array's items, innermost first."""
        out = []
        if self.value_kind is not None:
            out.append((self.value_kind, self.text[self.value_start:], self.value_start))
        arrays = [start for bracket, start in self.stack if bracket == "["]
        if arrays:
            out.append(("array", self.text[arrays[-1]:], arrays[-1]))
        return out


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


class TokenTexts:
    """Token id → its text alone, and the ids whose text starts by closing a string / a number / an array."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        n = min(vocab_size, tokenizer.vocab_size)
        backend = tokenizer._backend
        self.texts = [backend.decode([i], skip_special_tokens=False) for i in range(n)]
        special = set(tokenizer.stop_token_ids)
        first = [t[:1] if i not in special else "" for i, t in enumerate(self.texts)]
        self.closers = {
            "string": torch.tensor([i for i, c in enumerate(first) if c == '"'], dtype=torch.long),
            "number": torch.tensor([i for i, c in enumerate(first) if c and c in ",}] "], dtype=torch.long),
            "array": torch.tensor([i for i, c in enumerate(first) if c == "]"], dtype=torch.long),
        }
        # the ids that can end a member of an array/object or close it (examined by the repeated-members rule)
        self.structural = torch.tensor([i for i, t in enumerate(self.texts) if i not in special
                                        and any(c in t for c in '"}],')], dtype=torch.long)
        self._special = special
        self._by_text: dict[str, list[int]] | None = None

    def text(self, token: int) -> str:
        return self.texts[token] if 0 <= token < len(self.texts) else ""

    def ids_of(self, text: str) -> list[int]:
        """The ids of the (non-special) tokens whose text is `text` (the index is built on first use)."""
        if self._by_text is None:
            by_text: dict[str, list[int]] = {}
            for i, t in enumerate(self.texts):
                if t and i not in self._special:
                    by_text.setdefault(t, []).append(i)
            self._by_text = by_text  # one assignment: a concurrent request sees the whole index or builds its own
        return self._by_text.get(text, [])


_tables: weakref.WeakKeyDictionary[Tokenizer, dict[int, TokenTexts]] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def token_texts(tokenizer: Tokenizer, vocab_size: int) -> TokenTexts:
    """The per-tokenizer table (built once, about a second for a 150k vocabulary)."""
    with _tables_lock:
        per = _tables.setdefault(tokenizer, {})
        if vocab_size not in per:
            per[vocab_size] = TokenTexts(tokenizer, vocab_size)
        return per[vocab_size]


class LoopGuard:
    """The guard for one request; `process(generated, logits)` runs after the grammar mask."""

    def __init__(self, table: TokenTexts, cfg: LoopGuardConfig = DEFAULT_LOOP_GUARD) -> None:
        self.cfg = cfg
        self._table = table
        self._scanner = JSONScanner()
        self._seen = 0  # generated tokens already fed to the scanner
        self._value_id: tuple[str, int] = ("", -1)
        self._in_value = 0  # interventions inside the current value
        self._episodes = 0  # loops the current value fell into (a step without a loop between two)
        self._looping = False  # the previous step found a loop
        self._relapses = Relapses(cfg.min_chars)  # what the guard steered, to catch copies of it
        self._members = RepeatedMembers(table, cfg, self._relapses)
        self.closer: StringCloser | None = None  # a string the grammar does not let close yet (`attach`)
        # a value the guard already steered is watched closer: a loop it falls back into counts from two copies
        self._relapse = replace(cfg, min_repeats=2, masked_repeats=2)
        self.interventions = 0  # steps whose logits the guard changed
        self.closed = 0  # steps where it lifted the closing tokens

    def attach(self, patterns: Iterable[str], fork: Callable[[], Matcher]) -> None:
        """Let the guard steer a string whose closing quote the grammar still forbids toward its shortest close:
        `patterns` of the schema, `fork` a copy of the request's grammar matcher (`string_close`)."""
        self.closer = StringCloser(self._table, patterns, fork)

    def _sync(self, generated: Sequence[int]) -> None:
        for token in generated[self._seen:]:
            self._scanner.feed(self._table.text(token))
        self._seen = len(generated)

    def process(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Logits with the tokens that continue a detected loop penalized (a copy); `logits` itself when none."""
        self._sync(generated)
        steered = self._members.steer(self._scanner, logits)
        if steered is not None:
            self.interventions += 1
            return steered
        scanner = self._scanner
        if self._relapses.string_copy(scanner) and self._value_id != ("string", scanner.value_start):
            # a string copying one the guard already steered: closed at once, as a loop that persisted
            self._value_id, self._in_value = ("string", scanner.value_start), self.cfg.close_after
        loop = next((replace(found, start=start) for kind, text, start in self._scanner.segments()
                     if (found := find_loop(kind, text, self._thresholds(kind, start))) is not None), None)
        if loop is None:
            self._looping = False
            if self._in_value >= self.cfg.close_after and self._still_open():
                # a value that looped persistently and still is open: keep preferring to close it
                logits = logits.clone()
                if self._close(self._scanner.value_kind or self._value_id[0], logits):
                    self._acted()
            return logits
        if (loop.kind, loop.start) != self._value_id:  # escalation counts per looping value (an array: all items)
            self._value_id, self._in_value, self._episodes = (loop.kind, loop.start), 0, 0
        if not self._looping:
            self._episodes += 1
            if self._episodes >= self.cfg.close_episodes:  # the value loops again: the loop persists
                self._in_value = max(self._in_value, self.cfg.close_after)
        self._looping = True
        logits = logits.clone()  # the model's logits may be an inference tensor: never changed in place
        changed = self._penalize(loop, logits)
        if self._in_value >= self.cfg.close_after:  # close what is innermost: a string inside a looping array first
            changed = self._close(self._scanner.value_kind or loop.kind, logits) or changed
        if changed:
            self._in_value += 1
            self._acted()
        return logits

    def _acted(self) -> None:
        """Count a step the guard changed, and remember where (and the string it steered) for `Relapses`."""
        self.interventions += 1
        scanner = self._scanner
        in_string = scanner.value_kind == "string"
        self._relapses.note(len(scanner.text), scanner.value_start if in_string else None,
                            scanner.text[scanner.value_start:] if in_string else "")

    @property
    def member_steps(self) -> int:
        """Steps where the repeated-members rule steered toward closing an array/object."""
        return self._members.steps

    def _thresholds(self, kind: str, start: int) -> LoopGuardConfig:
        return self._relapse if self._in_value and (kind, start) == self._value_id else self.cfg

    def _still_open(self) -> bool:
        kind, start = self._value_id
        if kind == "array":
            return ("[", start) in self._scanner.stack
        return self._scanner.value_kind == kind and self._scanner.value_start == start

    def _penalize(self, loop: Loop, logits: torch.Tensor) -> bool:
        finite = torch.isfinite(logits)
        allowed = int(finite.sum())
        if allowed <= 1:
            return False
        k = min(self.cfg.candidates, allowed)
        top = torch.topk(logits, k).indices.tolist()
        hits = [t for t in top if continues(loop, self._table.text(t))]
        if not hits or len(hits) == allowed:
            return False  # nothing to steer to: the grammar allows only the loop
        amount = self.cfg.penalty * self.cfg.base ** min(self._in_value, 60)
        logits[torch.tensor(hits)] -= amount
        return True

    def _close(self, kind: str, logits: torch.Tensor) -> bool:
        ids = self._table.closers[kind]
        ids = ids[ids < logits.shape[-1]]
        if ids.numel() == 0:
            return False
        values = logits[ids]
        ok = torch.isfinite(values)
        if not bool(ok.any()):  # the grammar does not allow closing here (a pattern, minLength)
            return kind == "string" and self.closer is not None and self.closer.steer(logits)
        best = float(values[ok].max())
        top = float(logits.max())
        if best >= top:
            return False
        logits[ids[ok]] += top - best + 1.0
        self.closed += 1
        return True
