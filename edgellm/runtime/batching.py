"""Continuous batching: the sequences a server runs at once share one model step.

Each sequence (one choice of a request) runs the engine's own generation path (Engine.stream_on: sampling, stops,
grammar constraints, logprobs, prefix reuse, context shift) on a thread of its own, over a slot: a generation session
with its own KV cache whose model is a SlotModel. A SlotModel computes nothing itself: it posts the call and waits.
When no sequence is still working in Python (every one has posted its call, finished, or waits for a shared
prefill), the thread that finds so runs one step for the calls posted: the single-token calls, oldest first and at
most `max_batch` of them, as the rows of one `decode_batch` (the model's batched native step where it has one, else
one `run` per row: the same tokens either way), then at most one prompt chunk. A long prompt is so prefilled a chunk
per step while the running sequences keep decoding. Sequences join and leave between steps; a lone sequence runs its
steps on its own thread, with no hand-off.

`n > 1` choices of one prompt share its prefill (a Fork): the first choice prefills, the others copy its keys and
values and its last logits, which are the same bits they would have computed.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np

from edgellm.generation import GenerationStats
from edgellm.models.kv_space import KVSpace
from edgellm.models.protocol import decode_batch_by_run
from edgellm.session.generation_session import GenerationSession
from edgellm.session.prompt_cache import cache_arrays

if TYPE_CHECKING:
    from edgellm.runtime.engine import Engine

TRACE_STEPS = 4096  # the most recent steps kept in Batch.trace


class StepModel(Protocol):
    """What a batch steps: a model's single and batched calls over KV caches of its own making."""

    def run(self, ids: Sequence[int], start: int, cache: KVSpace, *, all_logits: bool = False) -> np.ndarray: ...

    def shift_cache(self, cache: KVSpace, end: int, keep: int, drop: int) -> bool: ...


class Dropped(Exception):
    """The sequence's request was cancelled or ran past its deadline: it leaves the batch at its next call."""


@dataclass
class _Call:
    """One model call a sequence waits on."""

    slot: int
    ids: list[int]
    start: int
    cache: KVSpace
    all_logits: bool
    result: np.ndarray | None = None
    error: BaseException | None = None
    done: bool = False

    @property
    def decode_row(self) -> bool:
        return len(self.ids) == 1 and not self.all_logits


@dataclass(frozen=True)
class StepRecord:
    """What one step ran: the slots decoded as rows, and the slot whose prompt chunk ran (with its length)."""

    rows: tuple[int, ...]
    chunk: tuple[int, int] | None


class Stepper:
    """The rendezvous of the batch's sequences: counts those working in Python, collects their posted calls and
    runs a step when none is working. Its condition guards the whole batch's state (queue.py's too)."""

    def __init__(self, model: StepModel, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.model = model
        self.max_batch = max_batch
        self.cond = threading.Condition()
        self.working = 0  # sequences running Python code (not waiting on a call or a fork)
        self.waiting: list[_Call] = []  # posted calls, oldest first
        self.stepping = False
        self.trace: deque[StepRecord] = deque(maxlen=TRACE_STEPS)
        self.steps = 0
        self.on_rows: Callable[[int], None] = lambda rows: None  # told each decode step's row count

    def close(self) -> None:
        """Drop the model (its weights go with the engine's close): no step runs after this."""
        self.__dict__.pop("model", None)

    def enter(self) -> None:
        """A sequence starts working (under `cond`): the next step waits for its call."""
        self.working += 1

    def leave(self) -> None:
        """A sequence stops working (under `cond`): finished, or parked on a fork."""
        self.working -= 1
        if self.working == 0:
            self.cond.notify_all()

    def call(self, call: _Call) -> np.ndarray:
        """Post `call` and wait for its logits, running steps meanwhile whenever nobody else is working."""
        with self.cond:
            self.waiting.append(call)
            self.leave()
            while not call.done:
                if self.working == 0 and not self.stepping and self.waiting:
                    self._step()
                else:
                    self.cond.wait()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    def _step(self) -> None:
        """One step over the posted calls (entered and left holding `cond`, released while the model runs)."""
        rows = [c for c in self.waiting if c.decode_row][: self.max_batch]
        chunk = next((c for c in self.waiting if not c.decode_row), None)
        served = rows + ([chunk] if chunk is not None else [])
        self.waiting = [c for c in self.waiting if not any(c is s for s in served)]
        self.stepping = True
        self.cond.release()
        try:
            if rows:
                self._decode(rows)
                self.on_rows(len(rows))
            if chunk is not None:
                try:
                    chunk.result = self.model.run(chunk.ids, chunk.start, chunk.cache, all_logits=chunk.all_logits)
                except BaseException as exc:  # noqa: BLE001 - the sequence that asked gets it
                    chunk.error = exc
        finally:
            self.cond.acquire()
            self.stepping = False
        for c in served:
            c.done = True
            self.enter()  # each served sequence works again until its next call
        self.steps += 1
        self.trace.append(StepRecord(tuple(c.slot for c in rows),
                                     (chunk.slot, len(chunk.ids)) if chunk is not None else None))
        self.cond.notify_all()

    def _decode(self, rows: list[_Call]) -> None:
        """One token per row: the model's batched step where it has one, else one decode step per row."""
        batched: Callable[..., np.ndarray] | None = getattr(self.model, "decode_batch", None)
        try:
            if batched is not None and len(rows) > 1:
                logits = batched([c.ids[0] for c in rows], [c.start for c in rows], [c.cache for c in rows])
                for i, c in enumerate(rows):
                    c.result = logits[i]
                return
        except BaseException as exc:  # noqa: BLE001 - every row of the failed step gets the error
            for c in rows:
                c.error = exc
            return
        for c in rows:
            try:
                c.result = self.model.run(c.ids, c.start, c.cache)
            except BaseException as exc:  # noqa: BLE001 - this row's sequence gets it
                c.error = exc


class SlotModel:
    """A slot's view of the model: its calls go through the batch's steps."""

    def __init__(self, stepper: Stepper, slot: int) -> None:
        self.stepper = stepper
        self.slot = slot
        self.chunk_invariant: bool = getattr(stepper.model, "chunk_invariant", False)
        self.check: Callable[[], None] = lambda: None  # raises Dropped when the running sequence is no longer wanted

    def run(self, ids: Sequence[int], start: int, cache: KVSpace, *, all_logits: bool = False) -> np.ndarray:
        self.check()
        return self.stepper.call(_Call(self.slot, [int(t) for t in ids], start, cache, all_logits))

    def shift_cache(self, cache: KVSpace, end: int, keep: int, drop: int) -> bool:
        return self.stepper.model.shift_cache(cache, end, keep, drop)

    def decode_batch(self, tokens: Sequence[int], positions: Sequence[int], caches: Sequence[KVSpace]) -> np.ndarray:
        """Each row as one of this slot's calls, in order (a speculative draft's rows)."""
        return decode_batch_by_run(self, tokens, positions, caches)


@dataclass
class _Prefilled:
    """A fork's shared prefill: the prompt, how much of it a fresh prefill computed, its KV copy, its last logits."""

    ids: list[int]
    prefilled: int
    cached_tokens: int
    arrays: tuple[np.ndarray, ...]
    logits: np.ndarray


@dataclass
class Fork:
    """The choices of one prompt (n > 1): the first prefills it, the others take a copy."""

    stepper: Stepper
    leader: int  # the choice index that prefills
    shared: _Prefilled | None = None
    settled: bool = False  # published, or abandoned (the others then prefill for themselves)
    parked: int = 0  # followers waiting for it (not counted as working)

    def publish(self, session: GenerationSession, ids: list[int], logits: np.ndarray, cached_tokens: int) -> None:
        n = len(ids)
        arrays = tuple(np.array(a[..., :n, :]) for a in cache_arrays(session.cache))
        with self.stepper.cond:
            self.shared = _Prefilled(list(ids), session.prefilled, cached_tokens, arrays, logits.copy())
            self._settle()

    def abandon(self) -> None:
        with self.stepper.cond:
            if not self.settled:
                self._settle()

    def _settle(self) -> None:  # under cond: the parked followers work again, counted before any next step
        self.settled = True
        for _ in range(self.parked):
            self.stepper.enter()
        self.parked = 0
        self.stepper.cond.notify_all()

    def wait(self) -> _Prefilled | None:
        """For a follower: the shared prefill once the leader has it (None: the leader gave up)."""
        with self.stepper.cond:
            if not self.settled:
                self.parked += 1
                self.stepper.leave()
                while not self.settled:
                    self.stepper.cond.wait()
            return self.shared


class SlotSession(GenerationSession):
    """A slot's generation session; its prefill is shared with the other choices of a fork."""

    fork: Fork | None = None
    choice: int = 0

    def prefill(self, ids: list[int], stats: GenerationStats, *, exact: bool = False) -> np.ndarray:
        fork = self.fork
        if fork is None:
            return super().prefill(ids, stats, exact=exact)
        if self.choice == fork.leader:
            logits = super().prefill(ids, stats, exact=exact)
            fork.publish(self, ids, logits, stats.cached_tokens)
            return logits
        shared = fork.wait()
        if shared is None or shared.ids != ids:
            return super().prefill(ids, stats, exact=exact)
        if self.prompt_cache is not None and self.cached_ids:
            self.prompt_cache.add(self.cached_ids, self.prefilled, self.cache)  # the live prefix it replaces
        self.cache.reserve(len(ids))
        for dst, src in zip(cache_arrays(self.cache), shared.arrays):
            dst[..., : len(ids), :] = src
        self.cached_ids, self.prefilled = list(ids), shared.prefilled
        stats.cached_tokens = shared.cached_tokens
        return shared.logits.copy()


@dataclass
class Slot:
    """One place in the batch: its session (made on first use) and whether a sequence holds it."""

    index: int
    model: SlotModel
    session: SlotSession | None = None
    busy: bool = False
    served: int = field(default=0)  # sequences it has run

    def shared_prefix(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` this slot's cache holds."""
        cached = self.session.cached_ids if self.session is not None else []
        n = 0
        for a, b in zip(cached, ids):
            if a != b:
                break
            n += 1
        return n


def slot_session(engine: Engine, model: SlotModel) -> SlotSession:
    """A fresh session for a slot: the engine's window, prefill chunk, sampling defaults and power mode, a KV cache
    of the engine's kind, the engine's prompt cache and reply memory (shared by every slot), and a draft runner of its own where the
    engine has a draft model (the model shared: the slots' draft calls take turns, session/speculative_draft.py)."""
    cache = engine.model.new_cache(engine.context_window, kind=engine.kv_cache)  # (torch's: the engine's kv_dtype)
    session = SlotSession(model, cache, context_window=engine.context_window, prefill_chunk=engine.prefill_chunk,
                          sampling=engine.config.sampling, power=engine.power)
    session.prompt_cache = engine.session.prompt_cache
    session.reply_memory = engine.session.reply_memory
    if engine.draft is not None:
        session.draft = engine.draft.runner()
    return session
