"""Batch jobs (runtime/batch_jobs.py, `edgellm run --batch`): one result line per prompt, the engine's own results,
resumable after a crash, every bad input line refused before anything runs."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import pytest

from edgellm.cli import main
from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams
from edgellm.runtime.batch_jobs import finished_ids, read_items, run_batch
from edgellm.runtime.batched import Request, generate_many
from edgellm.runtime.engine import Engine
from tests.cli.test_cli import edgellm
from tests.kernels.test_native_decode import _make_model
from tests.support.tiny import tiny_engine

GREEDY = GenerationParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = {"a": "t1 t2 t3", "b": "t9 t8", "c": "t4 t4 t4 t4", "d": "t7"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    return tiny_engine(tmp_path_factory.mktemp("batch"), "llama", tied=True)


def write_input(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def results(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["id"] for r in rows}) == len(rows)  # each id once
    return {r["id"]: r for r in rows}


def test_each_prompt_gives_the_engines_own_result(engine, tmp_path: Path) -> None:
    src = write_input(tmp_path / "in.jsonl", [{"id": k, "prompt": v} for k, v in PROMPTS.items()]
                      + [{"id": 7, "prompt": "t3 t3", "max_tokens": 2}])
    summary = run_batch(engine, read_items(src), tmp_path / "out.jsonl", GREEDY, raw=True, progress=False)
    assert (summary.done, summary.skipped) == (5, 0)
    got = results(tmp_path / "out.jsonl")
    for key, prompt in PROMPTS.items():
        engine.reset()
        want = engine.generate(prompt, GREEDY)
        assert got[key]["text"] == want.text and got[key]["finish_reason"] == "length"
        assert got[key]["usage"] == {"prompt_tokens": want.stats.prompt_tokens, "completion_tokens": 6}
    assert got["7"]["usage"]["completion_tokens"] == 2  # the line's own max_tokens


def test_a_job_resumes_where_it_stopped(engine, tmp_path: Path) -> None:
    src = write_input(tmp_path / "in.jsonl", [{"id": k, "prompt": v} for k, v in PROMPTS.items()])
    out = tmp_path / "out.jsonl"
    run_batch(engine, read_items(src)[:2], out, GREEDY, raw=True, progress=False)
    first = out.read_text()
    out.write_text(first + '{"id": "c", "text": "t4 t')  # a crash cut the third line short
    summary = run_batch(engine, read_items(src), out, GREEDY, raw=True, progress=False)
    assert (summary.done, summary.skipped) == (2, 2)
    assert out.read_text().startswith(first) and set(results(out)) == set(PROMPTS)
    assert finished_ids(out) == set(PROMPTS)


def test_a_prompt_that_cannot_run_gets_an_error_line(engine, tmp_path: Path) -> None:
    src = write_input(tmp_path / "in.jsonl", [{"id": "long", "prompt": " ".join(["t5"] * 300)},
                                              {"id": "ok", "prompt": "t1"}])
    run_batch(engine, read_items(src), tmp_path / "out.jsonl", GREEDY, raw=True, progress=False)
    got = results(tmp_path / "out.jsonl")
    assert "context window" in got["long"]["error"] and got["ok"]["finish_reason"] == "length"


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ([1, 2], "a line must be a JSON object"),
    ({"prompt": "t1"}, "\"id\" must be"),
    ({"id": True, "prompt": "t1"}, "\"id\" must be"),
    ({"id": "x"}, "exactly one of"),
    ({"id": "x", "prompt": "t1", "messages": []}, "exactly one of"),
    ({"id": "x", "prompt": ""}, "non-empty string"),
    ({"id": "x", "messages": [{"role": "user"}]}, "\"messages\" must be"),
    ({"id": "x", "prompt": "t1", "temperature": "hot"}, "\"temperature\" must be a number"),
    ({"id": "x", "prompt": "t1", "max_tokens": 2.5}, "(an integer)"),
    ({"id": "x", "prompt": "t1", "stop": [""]}, "\"stop\" must be"),
    ({"id": "x", "prompt": "t1", "colour": 1}, "unknown field 'colour'"),
    ({"id": "a", "prompt": "t1"}, "appears twice"),
])
def test_a_bad_line_is_named_before_anything_runs(tmp_path: Path, line: object, message: str) -> None:
    src = write_input(tmp_path / "in.jsonl", [{"id": "a", "prompt": "t1"}, line])
    with pytest.raises(EdgeLLMError, match=":2: ") as info:
        read_items(src)
    assert message in str(info.value)


def test_files_that_are_not_batch_files(tmp_path: Path) -> None:
    with pytest.raises(EdgeLLMError, match="has no prompts"):
        read_items(write_input(tmp_path / "empty.jsonl", []))
    with pytest.raises(EdgeLLMError, match="cannot read the batch file"):
        read_items(tmp_path / "missing.jsonl")
    (tmp_path / "other.jsonl").write_text("plain text\n")
    with pytest.raises(EdgeLLMError, match="not a batch output file"):
        finished_ids(tmp_path / "other.jsonl")


def test_the_cli_runs_a_batch_quietly_when_captured(engine, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = write_input(tmp_path / "in.jsonl", [{"id": k, "prompt": v} for k, v in PROMPTS.items()])
    out = tmp_path / "out.jsonl"
    model = str(engine.artifact.folder)
    argv = ["run", model, "--batch", str(src), "--output", str(out), "--raw", "--temperature", "0",
            "--max-tokens", "3"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"4 prompts run, 0 already in {re.escape(str(out))} \(\d+\.\d rows a decode step\)", last)
    assert "\r" not in err  # no bar frames
    assert set(results(out)) == set(PROMPTS)
    assert main(argv) == 0 and "0 prompts run, 4 already" in capsys.readouterr().err
    assert main(["run", model, "--batch", str(src)]) == 1
    assert capsys.readouterr().err.strip() == ("edgellm: error: give either PROMPT, or --batch FILE.jsonl with "
                                               "--output FILE.jsonl")
    assert main(["run", model, "--batch", str(src), "--output", str(tmp_path / "no" / "out.jsonl")]) == 1
    assert "cannot write the batch output" in capsys.readouterr().err
    assert main([*argv, "--parallel", "0"]) == 1
    assert capsys.readouterr().err.strip() == "edgellm: error: --parallel and --max-batch must be at least 1"
    assert main(["run", model, "--raw", "t1", "--parallel", "2"]) == 1
    assert "go with --batch" in capsys.readouterr().err


def test_each_result_is_on_disk_before_the_next_prompt_runs(engine, tmp_path: Path) -> None:
    """One slot (`parallel=1`): a prompt starts only once the one before it is written. With the default 4 slots
    the four prompts start together, and which of them reaches its first token after another's result is written
    is up to the threads (this test saw [0, 0, 2, 3] that way)."""
    out = tmp_path / "out.jsonl"
    seen: list[int] = []

    def count_lines(generated, logits):  # runs inside each prompt's token loop
        seen.append(len(out.read_text().splitlines()) if out.exists() else 0)
        return logits

    src = write_input(tmp_path / "in.jsonl", [{"id": k, "prompt": v} for k, v in PROMPTS.items()])
    params = GenerationParams(temperature=0.0, max_tokens=1, ignore_eos=True, logits_processors=(count_lines,))
    run_batch(engine, read_items(src), out, params, raw=True, progress=False, parallel=1)
    assert seen == [0, 1, 2, 3]


def test_the_cli_flags_of_the_prompt_cache_and_speculative_decoding(engine, tmp_path: Path) -> None:
    model = str(engine.artifact.folder)
    proc = edgellm("run", model, "--raw", "t1 t2 t3 t1 t2 t3 t1 t2", "--speculative", "lookup", "--stats",
                   "--temperature", "0", "-n", "8", "--prompt-cache", str(tmp_path / "pc"))
    assert proc.returncode == 0, proc.stderr
    assert "accepted" in proc.stderr and "prompt cache 256" in proc.stderr  # the drafts and the estimate in --stats
    proc = edgellm("run", model, "--raw", "t1", "--prompt-cache-mb", "-1")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "edgellm: error: the prompt cache's budget must not be negative"


class RowCounter:
    """The engine's model, its batched step counted (rows per call), computing with the model's own."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.chunk_invariant = getattr(model, "chunk_invariant", False)
        self.calls: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def decode_batch(self, tokens: Sequence[int], positions: Sequence[int], caches: Sequence[Any]) -> np.ndarray:
        self.calls.append(len(tokens))
        return self.model.decode_batch(tokens, positions, caches)


@pytest.fixture(scope="module")
def native_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A random 2-layer Llama (clear greedy winners) on the native model, whose decode_batch is the C batched step."""
    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert
    from edgellm.kernels import native

    if native.prefill_matmul() is None:
        pytest.skip("no native prefill in this kernel library")
    root = tmp_path_factory.mktemp("batched")
    _make_model(root / "hf", "llama", tied=True)
    return Engine(open_artifact(convert(root / "hf", root / "art", quantization="q4f16_1", progress=False)),
                  threads=1, huge_pages="off", runtime="native")


def test_prompts_decode_together_and_each_equals_its_solo_run(native_engine: Engine, tmp_path: Path) -> None:
    """Seven prompts on four slots, at most three rows a step: later prompts join as earlier ones finish."""
    prompts = {f"p{i}": [1 + (7 * i + 3 * j) % 200 for j in range(4 + 5 * i)] for i in range(7)}
    lengths = {key: 8 + 5 * i for i, key in enumerate(prompts)}
    solo = {}
    for key, ids in prompts.items():
        native_engine.reset()
        solo[key] = native_engine.generate(ids, replace_max(lengths[key])).token_ids
    counter = RowCounter(native_engine.model)
    model, native_engine.model = native_engine.model, counter
    got: dict[str, list[int]] = {}
    keys = list(prompts)
    try:
        steps = generate_many(native_engine, [Request(prompts[k], replace_max(lengths[k])) for k in keys],
                              lambda i, outcome: got.setdefault(keys[i], outcome.token_ids),  # type: ignore[union-attr]
                              parallel=4, max_batch=3)
    finally:
        native_engine.model = model
    assert got == solo
    assert max(counter.calls) == 3  # batched, never past max_batch
    assert steps.rows == sum(lengths.values()) - len(prompts)  # one row per token after the first
    assert sum(counter.calls) == steps.rows - (steps.steps - len(counter.calls))  # the rest: lone rows, run()


def replace_max(max_tokens: int) -> GenerationParams:
    return GenerationParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_an_error_in_one_slot_stops_them_all_and_reaches_the_caller(native_engine: Engine) -> None:
    requests = [Request([1 + i, 2, 3], replace_max(40)) for i in range(6)]
    seen: list[int] = []

    def fail_on_first(index: int, outcome: object) -> None:
        seen.append(index)
        raise RuntimeError("the output disk is full")

    with pytest.raises(RuntimeError, match="disk is full"):
        generate_many(native_engine, requests, fail_on_first, parallel=3)
    assert len(seen) == 1  # the other slots stopped at their next model call, their results never reported
    assert not [t for t in threading.enumerate() if t.name.startswith("edgellm-batch")]
    with pytest.raises(EdgeLLMError, match="parallel must be at least 1"):
        generate_many(native_engine, requests, fail_on_first, parallel=0)


def test_real_smollm2_batched_chat_replies_equal_their_solo_runs(smollm2_gguf: Path, tmp_path: Path) -> None:
    engine = Engine.load("smollm2-135m", progress=False, threads=1, sequences=4)
    questions = ["What is the capital of France?", "Name three colors.", "Count from one to five.",
                 "What is 2 + 2?", "Say hello in Spanish.", "What do bees make?"]
    src = write_input(tmp_path / "in.jsonl", [{"id": i, "prompt": q} for i, q in enumerate(questions)])
    params = GenerationParams(temperature=0.0, max_tokens=24)
    run_batch(engine, read_items(src), tmp_path / "out.jsonl", params, progress=False, parallel=4)
    got = results(tmp_path / "out.jsonl")
    for i, question in enumerate(questions):
        engine.reset()
        want = engine.chat([{"role": "user", "content": question}], params)
        assert got[str(i)]["text"] == want.text
    engine.close()
