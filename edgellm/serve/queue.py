"""One worker thread owns the engine; requests wait in a bounded queue and stream their chunks back to asyncio.

A full queue is refused at once (429 with Retry-After). Every chunk the engine yields is a token, and after each
one the worker checks the request's cancel flag (set when the client goes away) and its deadline, so a
disconnected or timed-out request frees the engine within one decode step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from edgellm.generation import GenerationParams, StreamChunk
from edgellm.serve.errors import QueueFullError, RequestTimeoutError
from edgellm.serve.metrics import Metrics

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

    def __init__(self, engine: Any, metrics: Metrics, *, max_queue: int = 8, timeout_s: float = 300.0) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.engine = engine
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._pending: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._running = 0
        self._avg_job_s = 2.0  # running estimate of a job's duration, for Retry-After
        self._thread = threading.Thread(target=self._work, name="edgellm-engine", daemon=True)
        self._thread.start()
        metrics.queue_depth = self._pending.qsize
        metrics.running = lambda: self._running

    def submit(self, runs: Sequence[Run], loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a job, or raise QueueFullError (429) at once when the queue is full."""
        job = Job(runs, loop, self.timeout_s)
        try:
            self._pending.put_nowait(job)
        except queue.Full:
            waiting = self._pending.qsize() + self._running
            raise QueueFullError(max(1, math.ceil(waiting * self._avg_job_s))) from None
        return job

    def idle(self) -> bool:
        """No job running or waiting."""
        return self._running == 0 and self._pending.empty()

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
