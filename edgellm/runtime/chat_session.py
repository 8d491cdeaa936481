"""A chat that outlives its context window: drop the oldest turns, shift inside long replies, rebuild.

Before each turn the oldest user/assistant turns are dropped (the system message stays) until the
rendered conversation leaves `reply_reserve` tokens free; a reply that still fills the window shifts
the context (session/context.py) with the system prompt as the kept head. Every `rebuild_every`
turns the KV cache is rebuilt from the kept messages (cleared, shrunk to one block and prefilled
again), which bounds both the drift a "rope" shift leaves and the cache's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from edgellm.errors import ContextOverflowError
from edgellm.session.context import DEFAULT_KEEP, check_method
from edgellm.generation import GenerationParams, GenerationStats, StreamChunk

if TYPE_CHECKING:
    from edgellm.runtime.engine import Engine

DEFAULT_REBUILD_EVERY = 16


@dataclass
class SessionStats:
    """What the session did to stay inside its window."""

    turns: int = 0
    dropped_messages: int = 0
    context_shifts: int = 0
    rebuilds: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"turns": self.turns, "dropped_messages": self.dropped_messages,
                "context_shifts": self.context_shifts, "rebuilds": self.rebuilds}


class ChatSession:
    """Messages plus the policy that keeps them inside `engine`'s window; one reply at a time."""

    def __init__(self, engine: Engine, system: str | None = None, *, rebuild_every: int | None = DEFAULT_REBUILD_EVERY,
                 reply_reserve: int | None = None, shift: str = "reencode") -> None:
        """rebuild_every: turns between cache rebuilds (None: never). reply_reserve: tokens kept free for a
        reply before it starts (default: a quarter of the window). shift: "reencode" or "rope"."""
        self.engine = engine
        self.system = [{"role": "system", "content": system}] if system else []
        self.history: list[dict[str, Any]] = []
        self.rebuild_every = rebuild_every
        self.reply_reserve = reply_reserve if reply_reserve is not None else engine.context_window // 4
        self.shift = check_method(shift)
        self.stats = SessionStats()
        self.last: GenerationStats | None = None
        self._keep = self._head_tokens()

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.system + self.history

    def _head_tokens(self) -> int:
        """Tokens of the rendered system message: the head a shift inside a reply keeps."""
        if not self.system:
            return DEFAULT_KEEP
        return len(self.engine.encode(self.engine.render(self.system, add_generation_prompt=False)))

    def _fit(self) -> list[int]:
        """The prompt ids of the kept messages; drops the oldest turns until the reply reserve is free."""
        limit = self.engine.context_window - self.reply_reserve
        while True:
            ids = self.engine.encode(self.engine.render(self.messages))
            if len(ids) <= limit or len(self.history) <= 1:
                break
            dropped = 1
            self.history.pop(0)
            while len(self.history) > 1 and self.history[0]["role"] != "user":  # drop a whole turn
                self.history.pop(0)
                dropped += 1
            self.stats.dropped_messages += dropped
        if len(ids) >= self.engine.context_window:
            raise ContextOverflowError(len(ids), self.engine.context_window)
        return ids

    def rebuild(self) -> None:
        """Forget the cache: the next turn prefills the kept messages from scratch into a one-block cache."""
        self.engine.reset()
        self.engine.cache.shrink()
        self.stats.rebuilds += 1

    def reset(self) -> None:
        """Start over, keeping the system message."""
        self.history.clear()
        self.rebuild()

    def replace_messages(self, messages: list[dict[str, Any]]) -> None:
        """Continue another conversation (e.g. one saved to a file): its system message and turns."""
        self.system = [m for m in messages if m["role"] == "system"][:1]
        self.history = [m for m in messages if m["role"] != "system"]
        self._keep = self._head_tokens()
        self.rebuild()

    def stream(self, text: str, params: GenerationParams | None = None) -> Generator[StreamChunk, None, None]:
        """Send a user message and stream the reply; the reply joins the history once it is complete, or
        as far as it got when the caller stops it (Ctrl-C, or closing the stream)."""
        if self.rebuild_every and self.stats.turns and self.stats.turns % self.rebuild_every == 0:
            self.rebuild()
        self.history.append({"role": "user", "content": text})
        reply: list[str] = []
        try:
            ids = self._fit()
            params = replace(params or GenerationParams(), context_shift=self.shift, context_keep=self._keep)
            for chunk in self.engine.stream(ids, params):
                reply.append(chunk.text)
                if chunk.stats is not None:
                    self.last = chunk.stats
                    self.stats.context_shifts += chunk.stats.context_shifts
                yield chunk
        except (GeneratorExit, KeyboardInterrupt):  # stopped by the user: keep the turn as far as it got
            self.history.append({"role": "assistant", "content": "".join(reply)})
            self.stats.turns += 1
            raise
        except BaseException:
            self.history.pop()
            raise
        self.history.append({"role": "assistant", "content": "".join(reply)})
        self.stats.turns += 1
