"""The engine's front: a bounded queue of requests, and the batch of sequences that runs them (runtime/batching.py).

A request is a job of one or more runs (its choices, `n > 1`, and its prompts); each run is a sequence that takes a
slot of the batch as one frees up, so up to `parallel` sequences decode together, one model step for all of them.
Requests beyond the slots wait; a full queue is refused at once (429 with Retry-After). Before each model call (the
next token's step, or the next chunk of a prompt being prefilled) a sequence checks its request's cancel flag (set
when the client goes away) and its deadline, so a disconnected or timed-out request leaves the batch within one step.

A constrained request's grammar is compiled before the job reaches the queue, on a thread of its own (xgrammar
releases the GIL while it compiles): the batch keeps serving other requests meanwhile, and the job is answered as
soon as its deadline passes or its client goes away, even while the compile still runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

from edgellm.generation import GenerationParams, StreamChunk
from edgellm.runtime.batching import Dropped, Fork, Slot, SlotModel, Stepper, slot_session
from edgellm.serve.errors import QueueFullError, RequestTimeoutError
from edgellm.serve.metrics import Metrics

if TYPE_CHECKING:
    from edgellm.runtime.engine import Engine

log = logging.getLogger("edgellm.serve")


@dataclass(frozen=True)
class Run:
    """One generation: a choice of the response (n > 1 and prompt lists make several, run side by side)."""

    prompt: Sequence[int]
    params: GenerationParams


@dataclass(frozen=True)
class Event:
    kind: Literal["chunk", "error", "end"]
    index: int = 0
    chunk: StreamChunk | None = None
    error: BaseException | None = None


class Job:
    """A request's runs, its cancel flag and deadline, and the asyncio queue its events arrive on."""

    def __init__(self, runs: Sequence[Run], loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.runs = tuple(runs)
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.started = False  # a run has taken a slot
        self.open = len(self.runs)  # runs not yet ended
        self.failed = False  # an error event went out (the job's last event)
        self.t0 = time.monotonic()

    def cancel(self) -> None:
        """Stop the job: dropped if queued, else each run stops after its current token or model call."""
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancelled.set()


@dataclass
class _Sequence:
    """One run of a job waiting for, or holding, a slot."""

    job: Job
    index: int
    run: Run
    fork: Fork | None  # its prompt's shared prefill when the job has several runs of it


class Scheduler:
    """The bounded queue in front of the engine and the batch of up to `parallel` sequences that runs it, at most
    `max_batch` (default: `parallel`) rows per decode step."""

    def __init__(self, engine: Engine, metrics: Metrics, *, max_queue: int = 8, timeout_s: float = 300.0,
                 parallel: int = 1, max_batch: int | None = None) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        if parallel < 1:
            raise ValueError("parallel must be at least 1")
        self.engine = engine
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.parallel = parallel
        self.stepper = Stepper(engine.model, parallel if max_batch is None else max_batch)
        self.stepper.on_rows = lambda rows: metrics.observe("edgellm_decode_step_rows", rows)
        self.slots = [Slot(i, SlotModel(self.stepper, i)) for i in range(parallel)]
        self._lock = self.stepper.cond  # one lock for the queue and the batch
        self._queued: deque[_Sequence] = deque()
        self._max_queue = max_queue
        self._preparing = 0  # jobs whose grammars are compiling (they count against max_queue too)
        self._running = 0  # sequences holding a slot
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._avg_job_s = 2.0  # running estimate of a job's duration, for Retry-After
        metrics.queue_depth = lambda: self._waiting_jobs() + self._preparing
        metrics.running = lambda: self._running

    def submit(self, runs: Sequence[Run], loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a job (through a grammar compile first when it is constrained), or raise QueueFullError (429) at
        once when the queue is full."""
        job = Job(runs, loop, self.timeout_s)
        constrained = any(_constrained(run) for run in job.runs)
        with self._lock:
            waiting = self._waiting_jobs() + self._preparing
            if waiting >= self._max_queue:
                # the jobs ahead leave `parallel` at a time; then the running ones' slots free up
                raise QueueFullError(max(1, math.ceil((waiting / self.parallel + 1) * self._avg_job_s)))
            if not constrained:
                self._enqueue(job)
                return job
            self._preparing += 1
        threading.Thread(target=self._prepare, args=(job,), name="edgellm-grammar", daemon=True).start()
        return job

    def idle(self) -> bool:
        """No sequence running, no job compiling its grammar or waiting."""
        return self._running == 0 and self._preparing == 0 and not self._queued

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (up to `timeout_s`) for the sequences to finish their bookkeeping after their job's last event."""
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the running sequences to end (after `close`), then release the slots' KV caches (each live
        prefix joins the prompt cache first)."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if self._running:
                return
            for slot in self.slots:
                if slot.session is not None:
                    slot.session.close()
                    slot.session = None
            self.stepper.close()

    def close(self) -> None:
        """Take no more sequences: queued jobs are dropped, running ones end as they would."""
        with self._lock:
            self._closed = True
            while self._queued:
                self._queued.popleft().job.cancel()

    def _waiting_jobs(self) -> int:
        return len({id(seq.job) for seq in self._queued if not seq.job.started})

    def _prepare(self, job: Job) -> None:
        """Compile the job's grammars (into the engine's grammar cache), then queue the job for the batch."""
        ready = self._compiled_in_time(job)
        with self._lock:
            self._preparing -= 1
            if ready and not self._closed:
                self._enqueue(job)  # its place was held while it compiled
            elif ready:
                job.cancel()

    def _compiled_in_time(self, job: Job) -> bool:
        """Run the compile on a helper thread and wait for it while the job is wanted and within its deadline.
        False when the job ended here (cancelled, timed out, or refused: the event is emitted)."""
        failure: list[BaseException] = []

        def compile_all() -> None:
            try:
                for run in job.runs:
                    if _constrained(run):
                        self.engine.constraint(run.params)  # compiled once; the sequence's call finds it cached
            except BaseException as exc:  # noqa: BLE001 - reported to the job, never raised on this thread
                failure.append(exc)

        compiler = threading.Thread(target=compile_all, name="edgellm-grammar-compile", daemon=True)
        compiler.start()
        while compiler.is_alive():
            compiler.join(0.05)
            if job.cancelled.is_set():
                return False
            if time.monotonic() > job.deadline:
                job.emit(Event("error", error=RequestTimeoutError(job.timeout_s)))
                return False
        if failure:
            job.emit(Event("error", error=failure[0]))
            return False
        return True

    # ---- the batch (every method below but the sequence's own run holds self._lock) --------------------------
    def _enqueue(self, job: Job) -> None:
        """Queue the job's runs, the runs of one prompt sharing its prefill, and start what fits."""
        forks: dict[tuple[int, ...], Fork] = {}
        for index, run in enumerate(job.runs):
            key = tuple(run.prompt)
            fork = None
            if sum(tuple(other.prompt) == key for other in job.runs) > 1:
                fork = forks.setdefault(key, Fork(self.stepper, leader=index))
            self._queued.append(_Sequence(job, index, run, fork))
        self._admit()

    def _admit(self) -> None:
        """Give free slots to queued sequences, in arrival order: each starts on a thread of its own and joins
        the batch at its first model call (the next step waits for it)."""
        while self._queued and not self._closed:
            seq = self._queued[0]
            if seq.job.cancelled.is_set() or seq.job.failed:
                self._queued.popleft()
                self._ended(seq.job)
                continue
            free = [slot for slot in self.slots if not slot.busy]
            if not free:
                return
            slot = max(free, key=lambda s: (s.shared_prefix(seq.run.prompt), -s.index))  # its prefix, if cached
            self._queued.popleft()
            slot.busy = True
            seq.job.started = True
            self._running += 1
            self.stepper.enter()
            thread = threading.Thread(target=self._sequence, args=(seq, slot), name=f"edgellm-slot-{slot.index}",
                                      daemon=True)
            self._threads.add(thread)
            thread.start()

    def _ended(self, job: Job) -> None:
        """One of the job's runs ended; after the last, the job's end event (unless it failed or was cancelled)."""
        job.open -= 1
        if job.open > 0:
            return
        self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * (time.monotonic() - job.t0)
        if not job.failed and not job.cancelled.is_set():
            job.emit(Event("end"))

    def _fail(self, job: Job, error: BaseException) -> None:
        """The job's error event (its last), once; its other runs stop."""
        with self._lock:
            if job.failed:
                return
            job.failed = True
        job.emit(Event("error", error=error))

    def _sequence(self, seq: _Sequence, slot: Slot) -> None:
        """A sequence's thread: run it on its slot, then give the slot to the next queued sequence."""
        try:
            self._run(seq, slot)
        except Dropped:
            pass
        except BaseException as exc:  # noqa: BLE001 - the batch must survive any request
            self._fail(seq.job, exc)
        finally:
            if seq.fork is not None:
                seq.fork.abandon()  # a no-op once its prefill is shared (or for a follower)
            with self._lock:
                slot.busy = False
                slot.served += 1
                self._running -= 1
                self.stepper.leave()
                self._ended(seq.job)
                self._threads.discard(threading.current_thread())
                self._admit()

    def _check(self, job: Job) -> None:
        """Before each model call: Dropped when the job is no longer wanted (a late one gets its timeout error)."""
        if job.cancelled.is_set() or job.failed:
            raise Dropped()
        if time.monotonic() > job.deadline:
            self._fail(job, RequestTimeoutError(job.timeout_s))
            raise Dropped()

    def _run(self, seq: _Sequence, slot: Slot) -> None:
        job, run = seq.job, seq.run
        self._check(job)
        if slot.session is None:
            slot.session = slot_session(self.engine, slot.model)
        session = slot.session
        slot.model.check = lambda: self._check(job)
        session.fork, session.choice = seq.fork, seq.index
        if run.params.seed is not None:
            # Reusing a cached prefix changes the last prompt token's logits in the low bits (a 1-token
            # forward pass instead of a chunk), which can flip a sampled token: a seed gets a cold cache,
            # so the same seed always gives the same text.
            session.reset()
        stream = self.engine.stream_on(session, run.prompt, run.params)  # its every model call runs _check first
        try:
            for chunk in stream:
                job.emit(Event("chunk", seq.index, chunk))
                if chunk.stats is not None:
                    self._record(chunk)
        finally:
            stream.close()

    def _record(self, chunk: StreamChunk) -> None:
        stats = chunk.stats
        assert stats is not None
        self.metrics.tokens(stats.prompt_tokens, stats.completion_tokens)
        if stats.completion_tokens > 0:
            self.metrics.observe("edgellm_time_to_first_token_seconds", stats.ttft_s)
        if stats.decode_tokens_per_s > 0:
            self.metrics.observe("edgellm_decode_tokens_per_second", stats.decode_tokens_per_s)

def _constrained(run: Run) -> bool:
    fmt = run.params.response_format
    return fmt is not None and fmt.type != "text"
