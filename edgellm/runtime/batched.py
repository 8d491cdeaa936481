"""Many requests through one engine at once: the server's continuous batch (runtime/batching.py) without a server.

Each of `parallel` slots runs its requests one after another on a thread of its own (Engine.stream_on over a slot
session: sampling, stops, grammar constraints, prefix reuse, as for a lone request); the slots' single-token calls
meet in the batch's Stepper and run as the rows of one `decode_batch` step, at most `max_batch` a step, and a slot
that finishes a request takes the next one at once, so requests join and leave between steps. A greedy result is
the tokens of its solo run (the batched step is the same arithmetic per row). Results arrive in the order requests
finish, each through `on_result` (called under a lock, one at a time).

A request's grammar is compiled outside the batch's count of working sequences, so a slow compile does not hold
the other slots' steps. Ctrl-C (or any error that is not the request's own EdgeLLMError) stops every slot at its
next model call (no result is reported after that), and the first such error is raised once they all have
stopped.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams, GenerationResult
from edgellm.runtime.batching import Dropped, SlotModel, SlotSession, Stepper, slot_session
from edgellm.runtime.engine import Engine, collect

DEFAULT_PARALLEL = 4  # as `edgellm serve --parallel`


@dataclass(frozen=True)
class Request:
    """One generation: a rendered prompt (text or token ids) and its parameters."""

    prompt: str | Sequence[int]
    params: GenerationParams


@dataclass(frozen=True)
class StepCounts:
    """The batch's decode steps and the rows they ran (rows / steps: how many requests a step decoded)."""

    steps: int = 0
    rows: int = 0


RequestOutcome = GenerationResult | EdgeLLMError  # a request's result, or why it could not run (too long, a bad parameter)


def generate_many(engine: Engine, requests: Sequence[Request], on_result: Callable[[int, RequestOutcome], None], *,
                  parallel: int = DEFAULT_PARALLEL, max_batch: int | None = None) -> StepCounts:
    """Run every request, `parallel` at once, their decode steps batched (at most `max_batch` rows, default
    `parallel`); `on_result(index, outcome)` as each finishes."""
    if parallel < 1:
        raise EdgeLLMError(f"parallel must be at least 1 (got {parallel})")
    if max_batch is not None and max_batch < 1:
        raise EdgeLLMError(f"max_batch must be at least 1 (got {max_batch})")
    if not requests:
        return StepCounts()
    stepper = Stepper(engine.model, max_batch if max_batch is not None else parallel)
    counted: list[int] = []  # each decode step's rows (one step runs at a time)
    stepper.on_rows = counted.append
    todo = deque(enumerate(requests))
    stop = threading.Event()
    failures: list[BaseException] = []
    report = threading.Lock()

    def check() -> None:
        if stop.is_set():
            raise Dropped()

    def take() -> tuple[int, Request] | None:
        with stepper.cond:
            return todo.popleft() if todo and not stop.is_set() else None

    def run_one(session: SlotSession, request: Request) -> RequestOutcome:
        try:
            with stepper.cond:
                stepper.leave()  # a grammar compile runs outside the batch: the other slots step meanwhile
            try:
                engine.constraint(request.params)  # compiled into the engine's cache: stream_on finds it there
            finally:
                with stepper.cond:
                    stepper.enter()
            if request.params.seed is not None:
                session.reset()  # a seed gets a cold cache, so the same seed gives the same text (as in serve)
            return collect(engine.stream_on(session, request.prompt, request.params))
        except EdgeLLMError as exc:
            return exc

    def slot(index: int) -> None:
        model = SlotModel(stepper, index)
        model.check = check
        session: SlotSession | None = None
        try:
            while (job := take()) is not None:
                if session is None:
                    session = slot_session(engine, model)
                outcome = run_one(session, job[1])
                with report:
                    if stop.is_set():
                        break  # nothing is reported after a stop (its cause may be on_result's own)
                    on_result(job[0], outcome)
        except Dropped:
            pass
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread once every slot stopped
            failures.append(exc)
            stop.set()
        finally:
            if session is not None:
                session.close()
            with stepper.cond:
                stepper.leave()

    slots = min(parallel, len(requests))
    with stepper.cond:
        for _ in range(slots):
            stepper.enter()  # every slot counted before any starts, so the first step waits for them all
    threads = [threading.Thread(target=slot, args=(i,), name=f"edgellm-batch-{i}", daemon=True)
               for i in range(slots)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)  # short waits: Ctrl-C reaches this thread
    except BaseException:
        stop.set()
        for thread in threads:
            thread.join()
        raise
    finally:
        stepper.close()
    if failures:
        raise failures[0]
    return StepCounts(len(counted), sum(counted))
