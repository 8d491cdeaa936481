"""Stop strings over streamed text: emit what cannot be part of a stop, hold back what still might be."""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    """Finds the first occurrence of any stop string in text fed piece by piece (empty stop strings are ignored).

    After a hit, `hit` is true and `matched` is the stop string found.
    """

    def __init__(self, stop_strings: str | Iterable[str]) -> None:
        if isinstance(stop_strings, str):  # OpenAI's `stop` may be one string
            stop_strings = [stop_strings]
        self._stops = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add `text`; return (text safe to emit now, whether a stop string was hit).

        On a hit the emitted text ends just before the stop string; everything after it, now and later, is dropped.
        """
        if self.hit:
            return "", True
        buffer = self._held + text
        hits = [(i, stop) for stop in self._stops if (i := buffer.find(stop)) >= 0]
        if hits:
            index, self.matched = min(hits)
            self._held = ""
            return buffer[:index], True
        held = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - held :]
        return buffer[: len(buffer) - held], False

    @property
    def hit(self) -> bool:
        """Whether a stop string has been found."""
        return self.matched is not None

    def flush(self) -> str:
        """End of text: the held-back suffix was not a stop after all, so return it."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = max((len(s) - 1 for s in self._stops), default=0)
        for n in range(min(longest, len(text)), 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0
