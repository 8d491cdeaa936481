"""Where a rewritten schema accepts less than the original: each narrowing, with its keyword and JSON pointer.

The rewrite (schema_normalize, schema_strings, schema_complement) may only narrow; every place that does notes it
here while a `collect()` block is open, so the request can report it (`result.narrowed`, the server's response,
`run`'s stderr) instead of generating from a smaller language silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Narrowing:
    """One keyword the grammar enforces more tightly than the schema asks: `keyword` at `pointer`, and how."""

    keyword: str
    pointer: str
    why: str

    def __str__(self) -> str:
        return f"{self.keyword} at {self.pointer or '/'}: {self.why}"

    def moved(self, old: str, new: str) -> Narrowing:
        """The same narrowing for a copy of the subschema at `old` now placed at `new`."""
        where = new + self.pointer[len(old):] if self.pointer.startswith(old) else self.pointer
        return Narrowing(self.keyword, where, self.why)


_current: ContextVar[list[Narrowing] | None] = ContextVar("edgellm_narrowings", default=None)
_lost: ContextVar[list[str] | None] = ContextVar("edgellm_lost_negations", default=None)


@contextmanager
def collect() -> Iterator[list[Narrowing]]:
    """The narrowings noted while the block runs (in order; a rewrite that is undone rolls them back)."""
    out: list[Narrowing] = []
    token = _current.set(out)
    try:
        yield out
    finally:
        _current.reset(token)


def note(keyword: str, pointer: str, why: str) -> None:
    """Record a narrowing (nothing happens outside a `collect()` block)."""
    out = _current.get()
    if out is not None:
        out.append(Narrowing(keyword, pointer, why))


def mark() -> int:
    """The position to roll back to if the rewrite in progress is undone."""
    out = _current.get()
    return len(out) if out is not None else 0


def since(position: int) -> list[Narrowing]:
    out = _current.get()
    return list(out[position:]) if out is not None else []


def rollback(position: int) -> None:
    out = _current.get()
    if out is not None:
        del out[position:]


def extend(items: list[Narrowing]) -> None:
    out = _current.get()
    if out is not None:
        out.extend(items)


@contextmanager
def lost_negations() -> Iterator[list[str]]:
    """The keywords whose negation a complement left out (it is then a part of the negation only)."""
    out: list[str] = []
    token = _lost.set(out)
    try:
        yield out
    finally:
        _lost.reset(token)


def lose(keyword: str) -> None:
    out = _lost.get()
    if out is not None:
        out.append(keyword)
