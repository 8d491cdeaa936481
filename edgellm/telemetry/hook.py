"""The one place generations are observed: wraps the engine's stream, records an event when it ends."""

from __future__ import annotations

import random
from collections.abc import Generator
from typing import TYPE_CHECKING

from edgellm.telemetry.settings import Settings, load_settings

if TYPE_CHECKING:
    from edgellm.generation import GenerationStats, StreamChunk
    from edgellm.telemetry.events import ObservedEngine


def observed(engine: ObservedEngine, chunks: Generator[StreamChunk, None, None]) -> Generator[StreamChunk, None, None]:
    """Pass ``chunks`` through; if telemetry is on (and this request is sampled), record how it ended:
    its finish reason, ``cancelled`` when the consumer stopped reading, or ``error`` with the exception class."""
    settings = load_settings()
    if not settings.enabled or random.random() >= settings.sample_rate:
        yield from chunks
        return
    finished = False
    try:
        for chunk in chunks:
            if chunk.finish_reason is not None:
                finished = True
                _record(engine, chunk.stats, chunk.finish_reason, None, settings)
            yield chunk
    except GeneratorExit:
        if not finished:
            _record(engine, None, "cancelled", None, settings)
        raise
    except Exception as exc:
        _record(engine, None, "error", type(exc).__name__, settings)  # the class only, never the message
        raise
    finally:
        chunks.close()


def _record(engine: ObservedEngine, stats: GenerationStats | None, finish: str, error_class: str | None, settings: Settings) -> None:
    from edgellm.telemetry.events import build_event
    from edgellm.telemetry.sink import insert

    try:
        insert(build_event(engine, stats, finish, error_class, settings.level), int(settings.max_db_mib * 2**20))
    except Exception:  # noqa: BLE001, S110 - a full disk or a locked database must never fail a generation
        pass
