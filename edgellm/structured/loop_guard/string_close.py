"""The shortest text that closes the open JSON string where the grammar does not let it close yet (a `pattern`).

A string under a pattern such as GitHub's `^.*\\$\\{\\{(.|[\\r\\n])*\\}\\}.*$` (an `env` value must hold an
expression) cannot end until its text matches: the closing quote stays forbidden, and a model that loops there
runs to max_tokens however hard the loop is penalized. The grammar has no "distance to the end" to ask, so the
candidates come from the schema: the shortest example of each of its patterns (`${{}}`) and every suffix of one.
The shortest candidate after which the grammar accepts the closing quote, checked on a fork of the grammar matcher,
is the plan; the allowed token that writes the longest start of it is lifted above every other. The loop guard
uses it for a looping string it has to close, the budget finish for a string it has to close in time.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any, Protocol

import numpy as np

from edgellm.structured.loop_guard.scanner import TokenTexts

PREFERRED = "a0A -_./:"  # the characters an example is written with where a class leaves the choice
MAX_CANDIDATES = 4096  # suffixes tried at most per step (about 2 us each), shortest first
_CATEGORIES = {
    sre.CATEGORY_DIGIT: str.isdigit, sre.CATEGORY_NOT_DIGIT: lambda c: not c.isdigit(),
    sre.CATEGORY_SPACE: str.isspace, sre.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
    sre.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
    sre.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
}


class Matcher(Protocol):
    """The part of xgrammar's GrammarMatcher a probe uses (a fork of the request's matcher)."""

    def accept_string(self, text: str) -> bool: ...


@functools.lru_cache(maxsize=4096)
def shortest_example(pattern: str) -> str | None:
    """A shortest string the regex `pattern` matches (None where it cannot be parsed or has no plain example)."""
    try:
        return _example(sre_parse.parse(pattern))
    except (re.error, RecursionError, OverflowError, ValueError, MemoryError):
        return None


def _example(items: Iterable[tuple[Any, Any]]) -> str | None:
    out = []
    for op, arg in items:
        if op is sre.AT:
            continue
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            low, _, sub = arg
            one = _example(sub) if low else ""
            if one is None or low * len(one) > 256:
                return None
            out.append(one * low)
            continue
        if op is sre.SUBPATTERN:
            part = _example(arg[-1])
        elif op is sre.ATOMIC_GROUP:
            part = _example(arg)
        elif op is sre.BRANCH:
            parts = [p for p in (_example(alt) for alt in arg[1]) if p is not None]
            part = min(parts, key=len) if parts else None
        else:
            part = _one_char(op, arg)
        if part is None:
            return None
        out.append(part)
    return "".join(out)


def _one_char(op: Any, arg: Any) -> str | None:
    """A character for a one-character item: a literal, `.`, a class (None for lookarounds, backreferences)."""
    if op is sre.LITERAL:
        return chr(arg)
    if op is sre.NOT_LITERAL:
        return next(c for c in PREFERRED + "b" if ord(c) != arg)
    if op is sre.ANY:
        return PREFERRED[0]
    if op is sre.IN:
        negate = bool(arg) and arg[0][0] is sre.NEGATE
        members = arg[1:] if negate else arg
        own = [chr(a) if o is sre.LITERAL else chr(a[0]) for o, a in members if o in (sre.LITERAL, sre.RANGE)]
        for c in list(PREFERRED) + ([] if negate else own) + [chr(c) for c in range(0x21, 0x7F)]:
            if _in_class(c, members) != negate:
                return c
    return None


def _in_class(c: str, members: list[tuple[Any, Any]]) -> bool:
    for op, arg in members:
        if (op is sre.LITERAL and ord(c) == arg) or (op is sre.RANGE and arg[0] <= ord(c) <= arg[1]) \
                or (op is sre.CATEGORY and _CATEGORIES.get(arg, lambda _: False)(c)):
            return True
    return False


def schema_patterns(schema: Any) -> tuple[str, ...]:
    """Every distinct `pattern` string of a schema (annotations such as `examples` are not looked into)."""
    found: dict[str, None] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found[node["pattern"]] = None
            stack.extend(v for k, v in node.items() if k not in ("pattern", "enum", "const", "default", "examples"))
        elif isinstance(node, list):
            stack.extend(node)
    return tuple(found)


class StringCloser:
    """Steers the open string toward the shortest text after which the grammar lets it close (see module doc)."""

    def __init__(self, table: TokenTexts, patterns: Iterable[str], fork: Callable[[], Matcher]) -> None:
        self._table = table
        self._fork = fork
        self._patterns = tuple(patterns)
        self._candidates: list[str] | None = None  # built on first use: most requests never need it
        self.steps = 0  # steps whose logits it changed

    def candidates(self) -> list[str]:
        """Every suffix of the patterns' shortest examples, JSON-escaped, shortest first."""
        if self._candidates is None:
            examples = {e for p in self._patterns if (e := shortest_example(p)) is not None}
            suffixes = {json.dumps(e[i:], ensure_ascii=False)[1:-1] for e in examples for i in range(len(e) + 1)}
            self._candidates = sorted(suffixes, key=lambda s: (len(s), s))[:MAX_CANDIDATES]
        return self._candidates

    def plan(self) -> str | None:
        """The shortest candidate text, closing quote included, that the grammar accepts next (None: none)."""
        candidates = self.candidates()
        if not candidates:
            return None
        matcher = self._fork()
        return next((text + '"' for text in candidates if matcher.accept_string(text + '"')), None)

    def steer(self, logits: np.ndarray) -> bool:
        """Lift the allowed token that writes the longest start of the plan above every other (in place)."""
        plan = self.plan()
        if plan is None:
            return False
        token = next((i for n in range(len(plan), 0, -1) for i in self._table.ids_of(plan[:n])
                      if i < logits.shape[-1] and bool(np.isfinite(logits[i]))), None)
        if token is None:
            return False
        top = float(logits.max())
        if float(logits[token]) >= top and int((logits == top).sum()) == 1:
            return False  # the model writes it anyway
        logits[token] = top + 1.0
        self.steps += 1
        return True
