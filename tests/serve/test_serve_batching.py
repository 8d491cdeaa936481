"""Continuous batching in the server (runtime/batching.py, serve/queue.py) on tiny random models from transformers:
each concurrent greedy reply is the tokens of its solo run, sequences join and leave between steps, one cancelled
or late sequence leaves while the others continue, a full queue is 429, a long prompt's prefill chunks interleave
with a running stream's decode steps (asserted on the step trace, never on timing), and n > 1 prefills once."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest

pytest.importorskip("transformers")

from edgellm.artifact.reader import open_artifact  # noqa: E402
from edgellm.convert.pipeline import convert  # noqa: E402
from edgellm.generation import GenerationParams  # noqa: E402
from edgellm.kernels import native  # noqa: E402
from edgellm.models.native_model import NativeModel  # noqa: E402
from edgellm.runtime.engine import Engine  # noqa: E402
from edgellm.serve.errors import QueueFullError, RequestTimeoutError  # noqa: E402
from edgellm.serve.metrics import Metrics  # noqa: E402
from edgellm.serve.queue import Event, Job, Run, Scheduler  # noqa: E402
from tests.kernels.test_native_decode import _make_model  # noqa: E402

GREEDY = GenerationParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["native", "torch"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A random 2-layer Llama on the native model where the library prefills natively, and on torch's path."""
    if request.param == "native" and native.prefill_matmul() is None:
        pytest.skip("no native prefill in this kernel library")
    root = tmp_path_factory.mktemp("batching")
    _make_model(root / "hf", "llama", tied=True)
    folder = convert(root / "hf", root / "art", quantization="q4f16_1", progress=False)
    eng = Engine(open_artifact(folder), threads=1, huge_pages="off", runtime=request.param)
    assert isinstance(eng.model, NativeModel) == (request.param == "native")
    return eng


def _prompts(count: int) -> list[list[int]]:
    return [[1 + (7 * i + 3 * j) % 200 for j in range(4 + 5 * i)] for i in range(count)]


async def _collect(job: Job, on_chunk: Any = None) -> tuple[list[int], Event | None]:
    """The job's tokens (choice 0) and its last event; `on_chunk(job, count)` after each chunk (True: stop
    listening, the last event is then None)."""
    ids: list[int] = []
    count = 0
    while True:
        event = await asyncio.wait_for(job.events.get(), 120)
        if event.kind != "chunk":
            return ids, event
        assert event.chunk is not None
        ids += event.chunk.token_ids
        count += 1
        if on_chunk is not None and on_chunk(job, count):
            return ids, None


class CountingBatch:
    """The engine's model with a `decode_batch` that loops over `run`, counting its calls and rows."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.chunk_invariant = getattr(model, "chunk_invariant", False)
        self.calls: list[int] = []

    def run(self, ids: Sequence[int], start: int, cache: Any, *, all_logits: bool = False) -> np.ndarray:
        return self.model.run(ids, start, cache, all_logits=all_logits)

    def shift_cache(self, cache: Any, end: int, keep: int, drop: int) -> bool:
        return bool(self.model.shift_cache(cache, end, keep, drop))

    def decode_batch(self, tokens: Sequence[int], positions: Sequence[int], caches: Sequence[Any]) -> np.ndarray:
        self.calls.append(len(tokens))
        return np.stack([self.model.run([t], p, c) for t, p, c in zip(tokens, positions, caches)])


class Gate:
    """A logits processor that holds its sequence while it picks token `at + 1`: `while_held(action)` waits until
    the sequence is there, runs the action and lets it go on, so what a test does on seeing token `at` lands at one
    known point of the sequence (never raced against a clock)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.reached = threading.Event()
        self.go = threading.Event()

    def __call__(self, generated: Sequence[int], logits: Any) -> Any:
        if len(generated) == self.at:
            self.reached.set()
            assert self.go.wait(60)
        return logits

    def while_held(self, action: Any) -> None:
        assert self.reached.wait(60)
        action()
        self.go.set()


def _drain(job: Job) -> list[Event]:
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


def _scheduler(engine: Engine, **kw: Any) -> Scheduler:
    scheduler = Scheduler(engine, Metrics(), **kw)
    return scheduler


def test_concurrent_greedy_replies_equal_their_solo_runs_and_join_mid_batch(engine: Engine) -> None:
    """Six requests on four slots, at most three rows a step: later ones join as earlier ones leave."""
    prompts = _prompts(6)
    params = [GenerationParams(temperature=0, max_tokens=10 + 6 * i, ignore_eos=True) for i in range(6)]
    solo = [engine.generate(p, q).token_ids for p, q in zip(prompts, params)]
    scheduler = _scheduler(engine, parallel=4, max_batch=3)

    async def main() -> list[tuple[list[int], Event]]:
        loop = asyncio.get_running_loop()
        jobs = [scheduler.submit([Run(p, q)], loop) for p, q in zip(prompts, params)]
        return list(await asyncio.gather(*(_collect(job) for job in jobs)))

    results = asyncio.run(main())
    assert [r[1].kind for r in results] == ["end"] * 6
    assert [r[0] for r in results] == solo
    trace = list(scheduler.stepper.trace)
    assert max(len(s.rows) for s in trace) == 3  # batched, never past max_batch
    assert any(s.rows and s.chunk is not None for s in trace)  # a sequence joined while others decoded
    assert sum(len(s.rows) for s in trace) == sum(len(t) - 1 for t in solo)  # one row per token after the first
    assert scheduler.wait_idle(5) and sorted(slot.served for slot in scheduler.slots)[-1] >= 2


def test_the_models_batched_step_is_called_with_every_row(engine: Engine) -> None:
    prompts = _prompts(3)
    solo = [engine.generate(p, GREEDY).token_ids for p in prompts]
    counting = CountingBatch(engine.model)
    scheduler = Scheduler(engine, Metrics(), parallel=3)
    scheduler.stepper.model = counting

    async def main() -> list[tuple[list[int], Event]]:
        loop = asyncio.get_running_loop()
        jobs = [scheduler.submit([Run(p, GREEDY)], loop) for p in prompts]
        return list(await asyncio.gather(*(_collect(job) for job in jobs)))

    assert [r[0] for r in asyncio.run(main())] == solo
    rows = [len(s.rows) for s in scheduler.stepper.trace if len(s.rows) > 1]
    assert counting.calls == rows and 3 in rows


def test_cancelling_one_stream_leaves_the_others_running(engine: Engine) -> None:
    prompts = _prompts(3)
    long = GenerationParams(temperature=0, max_tokens=40, ignore_eos=True)
    solo = [engine.generate(p, long).token_ids for p in prompts]
    scheduler = _scheduler(engine, parallel=3)
    hold = Gate(5)

    def cancel_at_5(job: Job, count: int) -> bool:
        if count == 5:
            hold.while_held(job.cancel)  # as the route cancels when its client goes away
        return count == 5

    async def main() -> tuple[list[tuple[list[int], Event | None]], Job]:
        loop = asyncio.get_running_loop()
        held = replace(long, logits_processors=(hold,))
        jobs = [scheduler.submit([Run(p, held if i == 1 else long)], loop) for i, p in enumerate(prompts)]
        tasks = [_collect(jobs[0]), _collect(jobs[1], cancel_at_5), _collect(jobs[2])]
        return list(await asyncio.gather(*tasks)), jobs[1]

    results, cancelled = asyncio.run(main())
    assert [r[1].kind for r in (results[0], results[2]) if r[1] is not None] == ["end", "end"]
    assert [results[0][0], results[2][0]] == [solo[0], solo[2]]
    assert scheduler.wait_idle(5)
    assert all(e.kind == "chunk" for e in _drain(cancelled))  # no end, no error after the cancel
    cancelled_rows = sum(s.rows.count(1) for s in scheduler.stepper.trace)  # job 1 was admitted to slot 1
    assert cancelled_rows == 5  # 6 tokens (the first from its prefill, the last picked when cancelled), no more
    cancelled_slot = 1  # admitted second
    rows_of = [s.rows.count(cancelled_slot) for s in scheduler.stepper.trace]
    assert sum(rows_of) <= 6  # it left within a step of its cancel (5 tokens: 4 decode rows, at most 2 more)


def test_a_late_stream_gets_its_timeout_and_the_others_continue(engine: Engine) -> None:
    prompts = _prompts(2)
    long = GenerationParams(temperature=0, max_tokens=30, ignore_eos=True)
    solo = engine.generate(prompts[0], long).token_ids
    scheduler = _scheduler(engine, parallel=2)
    hold = Gate(3)

    def late_at_3(job: Job, count: int) -> None:
        if count == 3:  # its deadline passes (as after timeout_s), decided by the test, not a clock
            hold.while_held(lambda: setattr(job, "deadline", 0.0))

    async def main() -> list[tuple[list[int], Event | None]]:
        loop = asyncio.get_running_loop()
        jobs = [scheduler.submit([Run(prompts[0], long)], loop),
                scheduler.submit([Run(prompts[1], replace(long, logits_processors=(hold,)))], loop)]
        return list(await asyncio.gather(_collect(jobs[0]), _collect(jobs[1], late_at_3)))

    (ids0, last0), (ids1, last1) = asyncio.run(main())
    assert last0.kind == "end" and ids0 == solo
    assert last1 is not None and last1.kind == "error" and isinstance(last1.error, RequestTimeoutError)
    assert len(ids1) == 4  # the token it was sampling when its deadline passed, then the timeout


def test_a_full_queue_is_refused_and_queued_jobs_run_when_a_slot_frees(engine: Engine) -> None:
    """Two slots held by requests whose logits processor waits for the test; one more waits; the next is 429."""
    release = threading.Event()

    def hold(generated: Sequence[int], logits: Any) -> Any:
        release.wait(60)
        return logits

    held = GenerationParams(temperature=0, max_tokens=3, ignore_eos=True, logits_processors=(hold,))
    scheduler = _scheduler(engine, parallel=2, max_queue=1)

    async def main() -> list[tuple[list[int], Event]]:
        loop = asyncio.get_running_loop()
        jobs = [scheduler.submit([Run(p, held)], loop) for p in _prompts(3)]  # two run, one waits
        with pytest.raises(QueueFullError) as refused:
            scheduler.submit([Run([5, 6], GREEDY)], loop)
        assert int(refused.value.headers["Retry-After"]) >= 1
        release.set()
        return list(await asyncio.gather(*(_collect(job) for job in jobs)))

    results = asyncio.run(main())
    assert [len(ids) for ids, _ in results] == [3, 3, 3] and all(e.kind == "end" for _, e in results)


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_streams_steps(engine: Engine) -> None:
    engine.prefill_chunk = 8
    try:
        scheduler = _scheduler(engine, parallel=2)
        hold = Gate(3)
        runner = GenerationParams(temperature=0, max_tokens=60, ignore_eos=True, logits_processors=(hold,))
        long_prompt = [1 + (5 * j) % 190 for j in range(45)]  # 6 chunks of at most 8

        async def main() -> tuple[tuple[list[int], Event], tuple[list[int], Event]]:
            loop = asyncio.get_running_loop()
            late: list[Job] = []

            def join_at_3(job: Job, count: int) -> None:
                if count == 3:
                    hold.while_held(lambda: late.append(scheduler.submit([Run(long_prompt, GREEDY)], loop)))

            first = await _collect(scheduler.submit([Run([3, 4, 5], runner)], loop), join_at_3)
            return first, await _collect(late[0])

        (ids_a, end_a), (ids_b, end_b) = asyncio.run(main())
        assert end_a.kind == end_b.kind == "end" and len(ids_a) == 60
        assert ids_b == engine.generate(long_prompt, GREEDY).token_ids
        trace = list(scheduler.stepper.trace)
        chunks = [i for i, s in enumerate(trace) if s.chunk is not None and s.chunk[0] == 1]
        assert [trace[i].chunk for i in chunks] == [(1, 8)] * 5 + [(1, 5)]
        assert all(trace[i].rows == (0,) for i in chunks)  # each chunk shared its step with the stream's token
        assert chunks == list(range(chunks[0], chunks[0] + 6))  # and the stream got one token per step meanwhile
    finally:
        engine.prefill_chunk = 256


def test_n_choices_share_one_prefill_and_each_equals_its_seeded_solo_run(engine: Engine) -> None:
    engine.prefill_chunk = 8
    try:
        prompt = [1 + (11 * j) % 180 for j in range(20)]  # 3 chunks
        sampled = GenerationParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=41)
        solo = [engine.generate(prompt, GenerationParams(temperature=0.9, max_tokens=16, ignore_eos=True,
                                                         seed=41 + i)).token_ids for i in range(3)]
        scheduler = _scheduler(engine, parallel=3)
        runs = [Run(prompt, GenerationParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=41 + i))
                for i in range(3)]
        assert sampled.seed == runs[0].params.seed

        async def main() -> dict[int, list[int]]:
            job = scheduler.submit(runs, asyncio.get_running_loop())
            out: dict[int, list[int]] = {0: [], 1: [], 2: []}
            while True:
                event = await asyncio.wait_for(job.events.get(), 120)
                if event.kind != "chunk":
                    assert event.kind == "end", event.error
                    return out
                assert event.chunk is not None
                out[event.index] += event.chunk.token_ids

        out = asyncio.run(main())
        assert [out[i] for i in range(3)] == solo
        assert len(set(map(tuple, solo))) > 1  # the seeds really differ
        chunk_steps = [s.chunk for s in scheduler.stepper.trace if s.chunk is not None]
        assert [c[1] for c in chunk_steps] == [8, 8, 4]  # prefilled once, not three times
        assert max(len(s.rows) for s in scheduler.stepper.trace) == 3  # then decoded side by side
    finally:
        engine.prefill_chunk = 256


def test_an_engine_error_reaches_its_job_and_the_batch_goes_on(engine: Engine) -> None:
    scheduler = _scheduler(engine, parallel=2)
    too_long = list(range(1, engine.context_window + 5))

    async def main() -> list[tuple[list[int], Event]]:
        loop = asyncio.get_running_loop()
        jobs = [scheduler.submit([Run(too_long, GREEDY)], loop), scheduler.submit([Run([7, 8, 9], GREEDY)], loop)]
        return list(await asyncio.gather(*(_collect(job) for job in jobs)))

    (_, bad), (ids, good) = asyncio.run(main())
    assert bad.kind == "error" and "context" in str(bad.error)
    assert good.kind == "end" and ids == engine.generate([7, 8, 9], GREEDY).token_ids


def test_parallel_and_max_batch_must_be_positive(engine: Engine) -> None:
    with pytest.raises(ValueError, match="parallel"):
        Scheduler(engine, Metrics(), parallel=0)
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(engine, Metrics(), parallel=2, max_batch=-1)


def test_the_prompt_cache_serves_a_prefix_another_slot_computed(engine: Engine) -> None:
    """Slot 0 prefills a long prompt, then another one (its live prefix goes to the shared prompt cache); a request
    sharing the first prompt's prefix, taken by slot 1 while slot 0 is busy, restores it from the prompt cache."""
    cached = Engine(open_artifact(engine.artifact.folder), threads=1, huge_pages="off", prompt_cache=2**24,
                    runtime="native" if isinstance(engine.model, NativeModel) else "torch")
    first = [1 + (13 * j) % 190 for j in range(80)]
    other = [2 + (17 * j) % 190 for j in range(70)]
    follow = first[:72] + [9, 8, 7]
    cached.prefill_chunk = engine.prefill_chunk = 8  # exact reuse keeps whole chunks (torch's path)
    hold = Gate(2)
    scheduler = _scheduler(cached, parallel=2)

    async def one(prompt: list[int], params: GenerationParams = GREEDY) -> tuple[list[int], Event | None]:
        return await _collect(scheduler.submit([Run(prompt, params)], asyncio.get_running_loop()))

    async def main() -> tuple[list[int], Any]:
        await one(first)  # slot 0
        busy = asyncio.ensure_future(one(other, replace(GREEDY, logits_processors=(hold,))))  # slot 0 again
        await asyncio.to_thread(hold.reached.wait, 60)  # slot 0 is busy with `other`: its `first` went to the cache
        job = scheduler.submit([Run(follow, GREEDY)], asyncio.get_running_loop())  # slot 1
        ids, last = [], None
        while True:
            event = await asyncio.wait_for(job.events.get(), 120)
            if event.kind != "chunk":
                break
            assert event.chunk is not None
            ids += event.chunk.token_ids
            last = event.chunk.stats or last
        hold.go.set()
        await busy
        return ids, last

    try:
        ids, stats = asyncio.run(main())
        assert stats is not None and stats.cached_tokens >= 64  # most of `first`, from the prompt cache
        assert cached.session.prompt_cache is not None and cached.session.prompt_cache.hits == 1
        assert ids == engine.generate(follow, GREEDY).token_ids
    finally:
        engine.prefill_chunk = 256
        cached.close()
