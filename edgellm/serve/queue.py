"""One worker thread owns the engine; requests wait in a bounded queue and stream their chunks back to asyncio.

A full queue is refused at once (429 with Retry-After). Every chunk the engine yields is a token, and after each
one the worker checks the request's cancel flag (set when the client goes away) and its deadline, so a
disconnected or timed-out request frees the engine within one decode step.

A constrained request's grammar is compiled before the job reaches the engine's queue, on a thread of its own
(xgrammar releases the GIL while it compiles): the engine keeps serving other requests meanwhile, and the job is
answered as soon as its deadline passes or its client goes away, even while the compile still runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence

from edgellm.generation import GenerationParams, StreamChunk
from edgellm.serve.errors import QueueFullError, RequestTimeoutError
from edgellm.serve.metrics import Metrics

if TYPE_CHECKING:
    from edgellm.runtime.engine import Engine

log = logging.getLogger("edgellm.serve")


@dataclass(frozen=True)
class Run:
    """One generation: a choice of the response (n > 1 and prompt lists make several, run one after another)."""

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

    def cancel(self) -> None:
        """Stop the job: the worker drops it if queued, or stops it after the current token."""
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancelled.set()


class Scheduler:
    """The bounded queue in front of the engine and the one thread that runs it."""

    def __init__(self, engine: Engine, metrics: Metrics, *, max_queue: int = 8, timeout_s: float = 300.0) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.engine = engine
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._pending: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._max_queue = max_queue
        self._preparing = 0  # jobs whose grammars are compiling (they count against max_queue too)
        self._slots = threading.Lock()
        self._running = 0
        self._avg_job_s = 2.0  # running estimate of a job's duration, for Retry-After
        self._thread = threading.Thread(target=self._work, name="edgellm-engine", daemon=True)
        self._thread.start()
        metrics.queue_depth = lambda: self._pending.qsize() + self._preparing
        metrics.running = lambda: self._running

    def submit(self, runs: Sequence[Run], loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a job (through a grammar compile first when it is constrained), or raise QueueFullError (429) at
        once when the queue is full."""
        job = Job(runs, loop, self.timeout_s)
        constrained = any(_constrained(run) for run in job.runs)
        with self._slots:
            if self._pending.qsize() + self._preparing >= self._max_queue:
                waiting = self._pending.qsize() + self._preparing + self._running
                raise QueueFullError(max(1, math.ceil(waiting * self._avg_job_s)))
            if not constrained:
                self._pending.put_nowait(job)
                return job
            self._preparing += 1
        threading.Thread(target=self._prepare, args=(job,), name="edgellm-grammar", daemon=True).start()
        return job

    def idle(self) -> bool:
        """No job running, compiling its grammar or waiting."""
        return self._running == 0 and self._preparing == 0 and self._pending.empty()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (up to `timeout_s`) for the worker to finish its job's bookkeeping after the job's last event."""
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the worker to stop (after `close`)."""
        self._thread.join(timeout_s)

    def _prepare(self, job: Job) -> None:
        """Compile the job's grammars (into the engine's grammar cache), then queue the job for the engine."""
        ready = self._compiled_in_time(job)
        with self._slots:
            self._preparing -= 1
            if ready:
                try:
                    self._pending.put_nowait(job)  # its slot was held while it compiled
                except queue.Full:  # only when the server is closing (its stop marker takes a slot)
                    job.cancel()

    def _compiled_in_time(self, job: Job) -> bool:
        """Run the compile on a helper thread and wait for it while the job is wanted and within its deadline.
        False when the job ended here (cancelled, timed out, or refused: the event is emitted)."""
        failure: list[BaseException] = []

        def compile_all() -> None:
            try:
                for run in job.runs:
                    if _constrained(run):
                        self.engine.constraint(run.params)  # compiled once; the worker's call finds it cached
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

    def close(self) -> None:
        """Stop the worker after the current job (queued jobs are dropped)."""
        while True:
            try:
                job = self._pending.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
        try:
            self._pending.put(None, timeout=1.0)
        except queue.Full:
            pass

    # ---- the worker thread ------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._pending.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            self._running = 1
            t0 = time.monotonic()
            try:
                self._run(job)
            except BaseException as exc:  # noqa: BLE001 - the worker must survive any request
                job.emit(Event("error", error=exc))
            finally:
                self._running = 0
                self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * (time.monotonic() - t0)

    def _run(self, job: Job) -> None:
        for index, run in enumerate(job.runs):
            if time.monotonic() > job.deadline:
                job.emit(Event("error", error=RequestTimeoutError(job.timeout_s)))
                return
            if run.params.seed is not None:
                # Reusing a cached prefix changes the last prompt token's logits in the low bits (a 1-token
                # forward pass instead of a chunk), which can flip a sampled token: a seed gets a cold cache,
                # so the same seed always gives the same text.
                self.engine.reset()
            stream = self.engine.stream(run.prompt, run.params)
            try:
                for chunk in stream:
                    job.emit(Event("chunk", index, chunk))
                    if chunk.stats is not None:
                        self._record(chunk)
                    if job.cancelled.is_set():
                        return
                    if chunk.finish_reason is None and time.monotonic() > job.deadline:
                        job.emit(Event("error", error=RequestTimeoutError(job.timeout_s)))
                        return
            finally:
                stream.close()
        job.emit(Event("end"))

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
