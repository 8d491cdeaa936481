"""`edgellm select`: constraints parsing, pass/fail and margins, Pareto and the pick on synthetic results,
cache hits, a candidate that fails to load, the Ray path on a local instance, and the CLI end to end."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edgellm.select import measure
from edgellm.errors import EdgeLLMError
from edgellm.select.candidates import Candidate, expand
from edgellm.select.constraints import ConstraintsError, Limit, Method, Space, load_constraints, parse_constraints
from edgellm.select.decide import pick, rows_for
from edgellm.select.executor import device_classes, jobs_for, run_local
from edgellm.select.measure import Job
from edgellm.select.report import table

BASE = {"candidates": {"models": ["m"]}}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "[candidates] is required"),
        ({"candidates": {"schemes": ["q4f16_1"]}}, "[candidates] models is required"),
        ({"candidates": {"models": []}}, "models must be a non-empty list"),
        ({"candidates": {"models": ["m"], "backends": ["vllm"]}}, "backends must be a list of edgellm / llama.cpp"),
        ({"candidates": {"models": ["m"], "threads": [0]}}, "threads must be >= 1"),
        ({"candidates": {"models": ["m"], "thread": [1]}}, "[candidates] unknown field 'thread'"),
        ({**BASE, "method": {"runs": 0}}, "[method] needs runs >= 1"),
        ({**BASE, "method": {"runs": 1.5}}, "[method] runs must be a whole number"),
        ({**BASE, "constraints": {"decode_tok_s_max": 5}}, "decode_tok_s is better higher; use decode_tok_s_min"),
        ({**BASE, "constraints": {"speed_min": 5}}, "'speed_min' is not <metric>_max or <metric>_min"),
        ({**BASE, "constraints": {"kl_max": "small"}}, "kl_max must be a number"),
        ({**BASE, "weights": {"kl": -1}}, "[weights] kl must be a number >= 0"),
        ({**BASE, "weights": {"speed": 1}}, "[weights] unknown metric 'speed'"),
        ({**BASE, "device": {"class": ""}}, "[device] class must be a non-empty string"),
        ({**BASE, "limits": {}}, "unknown table [limits]"),
        ({"candidates": {"models": ["m"], "references": {"x": "m"}}}, "references names 'x', which is not in models"),
        ({"candidates": {"models": ["m"], "references": {"m": 3}}}, "references must be a table of model = reference"),
        ({"candidates": {"models": ["m"], "references": ["m"]}}, "references must be a table of model = reference"),
    ],
)
def test_constraint_errors_name_the_field(raw, message):
    with pytest.raises(ConstraintsError) as info:
        parse_constraints(raw)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_file_errors(tmp_path: Path):
    with pytest.raises(ConstraintsError, match="does not exist"):
        load_constraints(tmp_path / "none.toml")
    bad = tmp_path / "c.toml"
    bad.write_text("[candidates\n")
    with pytest.raises(ConstraintsError, match="is not valid TOML"):
        load_constraints(bad)


def test_limits_and_margins():
    assert Limit("kl", "max", 0.05).margin(0.04) == pytest.approx(0.2)
    assert Limit("kl", "max", 0.05).margin(0.06) == pytest.approx(-0.2)
    assert Limit("decode_tok_s", "min", 20).margin(25) == pytest.approx(0.25)
    assert not Limit("decode_tok_s", "min", 20).passes(None)
    assert Limit("decode_tok_s", "min", 20).passes(20)


def test_expand_and_jobs_share_quality_across_threads():
    space = Space(models=("a",), schemes=("q4f16_1", "q8f16_1"), backends=("edgellm", "llama.cpp"),
                  threads=(1, 2), contexts=(512,))
    cands, skipped = expand(space, llama_cpp_available=False)
    assert len(cands) == 4 and len(skipped) == 2
    assert all("llama-cpp-python is not installed" in why for _, why in skipped)
    jobs = jobs_for(cands, Method(), speed=True, quality=True, task=True)
    kinds = [j.kind for j in jobs]
    assert kinds.count("speed") == 4 and kinds.count("quality") == 2 and kinds.count("task") == 2


def synthetic(constraints_raw: dict[str, Any], table_: dict[str, dict[str, float]]):
    c = parse_constraints(constraints_raw)
    cands = [Candidate("m", scheme, "edgellm", 1, 512) for scheme in table_]
    results = {}
    for cand in cands:
        metrics = table_[cand.scheme]
        results[Job("speed", cand, c.method)] = {"kind": "speed", **{k: v for k, v in metrics.items()
                                                                      if k in ("decode_tok_s", "peak_memory_mib")}}
        results[Job("quality", cand, c.method)] = {"kind": "quality", **{k: v for k, v in metrics.items() if k == "kl"}}
    return c, cands, results


def test_pass_fail_margins_pareto_and_pick():
    raw = {**BASE, "constraints": {"decode_tok_s_min": 50, "kl_max": 0.05, "peak_memory_mib_max": 500},
           "weights": {"decode_tok_s": 1.0, "kl": 1.0}}
    c, cands, results = synthetic(raw, {
        "fast": {"decode_tok_s": 100, "kl": 0.04, "peak_memory_mib": 300},
        "accurate": {"decode_tok_s": 60, "kl": 0.001, "peak_memory_mib": 400},
        "dominated": {"decode_tok_s": 55, "kl": 0.045, "peak_memory_mib": 450},
        "too-slow": {"decode_tok_s": 40, "kl": 0.0001, "peak_memory_mib": 200},
        "too-big": {"decode_tok_s": 200, "kl": 0.01, "peak_memory_mib": 900},
    })
    rows = {r.candidate.scheme: r for r in rows_for(c, cands, [], results)}
    assert [s for s, r in rows.items() if r.passed] == ["fast", "accurate", "dominated"]
    slow = rows["too-slow"]
    assert [ch.passed for ch in slow.checks] == [False, True, True]
    assert slow.checks[0].margin == pytest.approx(-0.2)  # 40 vs >= 50
    assert "decode_tok_s_min 50: 40" in slow.reason()
    assert rows["too-big"].checks[2].margin == pytest.approx(-0.8)
    assert {s for s, r in rows.items() if r.pareto} == {"fast", "accurate"}
    best, reason = pick(list(rows.values()))
    # normalized over passing rows: fast = 1 (speed) + 0.11 (kl); accurate = 0.11 + 1; dominated = 0 + 0
    assert best is not None and best.candidate.scheme in ("fast", "accurate")
    assert reason.startswith(best.candidate.id) and "meets all 3 constraints" in reason
    text = table(c, list(rows.values()), best)
    assert "FAIL -20%" in text and "ok +100%" in text


def test_weights_decide_between_pareto_points():
    raw = {**BASE, "constraints": {"kl_max": 1}, "weights": {"kl": 1.0, "decode_tok_s": 0.1}}
    c, cands, results = synthetic(raw, {"fast": {"decode_tok_s": 100, "kl": 0.04},
                                        "accurate": {"decode_tok_s": 60, "kl": 0.001}})
    best, _ = pick(rows_for(c, cands, [], results))
    assert best is not None and best.candidate.scheme == "accurate"


def test_nothing_passes_names_the_closest():
    raw = {**BASE, "constraints": {"decode_tok_s_min": 500}}
    c, cands, results = synthetic(raw, {"a": {"decode_tok_s": 100, "kl": 0.0}, "b": {"decode_tok_s": 400, "kl": 0.0}})
    best, reason = pick(rows_for(c, cands, [], results))
    assert best is None and "m b" in reason.split("closest")[1]


def test_failed_measurement_is_a_row_not_a_crash():
    c = parse_constraints({**BASE, "constraints": {"decode_tok_s_min": 1}})
    cand = Candidate("m", "q4f16_1", "edgellm", 1, 512)
    rows = rows_for(c, [cand], [(Candidate("m", "gguf", "llama.cpp", 1, 512), "llama-cpp-python is not installed")],
                    {Job("speed", cand, c.method): {"kind": "speed", "error": "does not fit in memory"}})
    assert [r.passed for r in rows] == [False, False]
    assert rows[1].reason() == "speed: does not fit in memory"


class CallLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def append(self, line: str) -> None:
        with open(self.path, "a") as fh:
            fh.write(line + "\n")

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines()

    def clear(self) -> None:
        self.path.write_text("")


@pytest.fixture()
def fake_measure(monkeypatch, tmp_path):
    """Replace the real measurements with counted fakes (the cache and the executor stay real). The pool's
    workers are forked, so the fakes log their calls to a file."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    calls = CallLog(tmp_path / "calls.log")
    monkeypatch.setattr(measure, "weights_fingerprint", lambda cand: f"w:{cand.model}:{cand.scheme}")
    monkeypatch.setattr(measure, "reference_fingerprint", lambda cand: f"r:{cand.quality_reference}")

    def speed(job):
        calls.append(f"speed {job.candidate.id}")
        if job.candidate.scheme == "broken":
            raise RuntimeError("cannot allocate memory")
        return {"decode_tok_s": 10.0 * job.candidate.threads, "peak_memory_mib": 100.0}

    def quality(job):
        calls.append(f"quality {job.candidate.scheme}")
        return {"kl": 0.01}

    monkeypatch.setitem(measure.MEASURE, "speed", speed)
    monkeypatch.setitem(measure.MEASURE, "quality", quality)
    return calls


def test_cache_hits_skip_measurement_and_changes_remeasure(fake_measure):
    c = parse_constraints({"candidates": {"models": ["m"], "schemes": ["q4", "broken"], "threads": [1, 2]},
                           "constraints": {"decode_tok_s_min": 15, "kl_max": 0.1}})
    cands, _ = expand(c.space, llama_cpp_available=False)
    jobs = jobs_for(cands, c.method, speed=True, quality=True, task=False)
    first = run_local(jobs, "dev", workers=1)["dev"]
    assert len(fake_measure.lines()) == 6 and not any(r["cached"] for r in first.values())
    rows = rows_for(c, cands, [], first)
    broken = [r for r in rows if r.candidate.scheme == "broken"]
    assert all("RuntimeError: cannot allocate memory" in r.reason() for r in broken)
    best, _ = pick(rows)
    assert best is not None and best.candidate.id == "m q4 edgellm t2 ctx2048"
    fake_measure.clear()
    again = run_local(jobs, "dev", workers=1)["dev"]
    assert fake_measure.lines() == [] and all(r["cached"] for r in again.values())
    changed = jobs_for(cands, Method(runs=7), speed=True, quality=True, task=False)
    run_local(changed, "dev", workers=1)
    assert sorted(fake_measure.lines()) == sorted(f"speed {c.id}" for c in cands)  # quality does not depend on runs
    fake_measure.clear()
    run_local(jobs, "other-device", workers=1)
    assert len(fake_measure.lines()) == 6  # results are per device class


def test_max_time_leaves_rows_not_measured(fake_measure):
    c = parse_constraints({"candidates": {"models": ["m"], "schemes": ["q4"]}, "constraints": {"kl_max": 1}})
    cands, _ = expand(c.space, llama_cpp_available=False)
    results = run_local(jobs_for(cands, c.method, speed=True, quality=True, task=False), "dev",
                        max_time_s=1e-9)["dev"]
    assert all("the --max-time budget ran out" in r["error"] for r in results.values())
    assert fake_measure.lines() == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_on_a_terminal_only(fake_measure, monkeypatch, terminal):
    c = parse_constraints({"candidates": {"models": ["m"], "schemes": ["q4"], "threads": [1, 2]},
                           "constraints": {"kl_max": 1, "decode_tok_s_min": 1}})
    cands, _ = expand(c.space, llama_cpp_available=False)
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    run_local(jobs_for(cands, c.method, speed=True, quality=True, task=False), "dev", workers=1)
    shown = err.getvalue()
    if terminal:  # the bar, drawn from the start, names each job as it starts (before any count moves)
        assert "select (dev):   0%" in shown and "0/3" in shown and "quality m q4 edgellm t1" in shown, shown
        assert "speed m q4 edgellm t1" in shown and "speed m q4 edgellm t2" in shown, shown
    else:
        assert shown == ""


def test_ray_local_instance_matches_the_local_executor(fake_measure, tmp_path):
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    from edgellm.select.executor import run_ray

    c = parse_constraints({"candidates": {"models": ["m"], "schemes": ["q4", "q8"]},
                           "constraints": {"decode_tok_s_min": 5, "kl_max": 0.1}})
    cands, _ = expand(c.space, llama_cpp_available=False)
    jobs = jobs_for(cands, c.method, speed=True, quality=True, task=False)
    local = run_local(jobs, "laptop", workers=1)

    def job_on_node(job, device_class, use_cache):  # a closure: Ray ships it by value to its worker processes
        from edgellm.select import measure as m

        m.weights_fingerprint = lambda cand: f"w:{cand.model}:{cand.scheme}"
        m.reference_fingerprint = lambda cand: f"r:{cand.quality_reference}"
        m.MEASURE["speed"] = lambda j: {"decode_tok_s": 10.0, "peak_memory_mib": 100.0}
        m.MEASURE["quality"] = lambda j: {"kl": 0.01}
        return m.run_job(job, device_class, use_cache)

    try:
        remote = run_ray(jobs, "local", use_cache=False, job_fn=job_on_node, init_kwargs={
            "num_cpus": 2, "resources": {"edgellm_device:laptop": 1, "edgellm_device:phone": 1},
            "include_dashboard": False, "runtime_env": {"env_vars": {"EDGELLM_HOME": str(tmp_path / "home")}}})
    finally:
        ray.shutdown()
    assert set(remote) == {"laptop", "phone"}
    for cls in remote:
        assert set(remote[cls]) == set(local["laptop"])
        for job, result in remote[cls].items():
            assert set(result) == set(local["laptop"][job]) and "error" not in result
        rows = rows_for(c, cands, [], remote[cls])
        assert [r.passed for r in rows] == [True, True]


def test_device_classes_from_cluster_resources():
    assert device_classes({"CPU": 4, "edgellm_device:phone": 1, "edgellm_device:laptop": 2}) == ["laptop", "phone"]


def test_cli_bad_file_is_one_line(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text('[candidates]\nmodels = ["m"]\n[constraints]\nspeed_min = 1\n')
    out = subprocess.run([sys.executable, "-m", "edgellm", "select", "-c", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"edgellm: error: constraints file {path}: [constraints] 'speed_min' is not <metric>_max or <metric>_min; metrics: "
        "ttft_p90_ms, ttft_ms, decode_tok_s, prefill_tok_s, peak_memory_mib, load_s, kl, ppl_ratio, top1, "
        "task_valid_json, task_fields_complete, task_values_correct"]


@pytest.mark.slow
def test_cli_end_to_end_on_the_real_model(tmp_path: Path):
    """Two real candidates measured with the bench and eval code, a KL bound between them (q4f16_1's 4-bit output
    layer loses 0.06-0.08 on this window, q4f16_1e8 0.002-0.005: a factor of 3 either side of 0.02), so one passes,
    one fails for that reason and is not picked; the JSON and PNG are written."""
    path = tmp_path / "c.toml"
    path.write_text("""
[candidates]
models = ["smollm2-135m"]
schemes = ["q4f16_1", "q4f16_1e8"]
context = [256]
[method]
prompt_tokens = 32
gen_tokens = 8
warmup = 0
runs = 1
quality_ctx = 64
quality_windows = 1
task_items = 0
[constraints]
kl_max = 0.02
""")
    out = subprocess.run([sys.executable, "-m", "edgellm", "select", "-c", str(path), "--json", str(tmp_path / "o.json"),
                          "--png", str(tmp_path / "o.png")], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "o.json").read_text())
    rows = data["device_classes"]["this-device"]["rows"]
    e8 = next(r for r in rows if "q4f16_1e8" in r["candidate"]["id"])
    q4 = next(r for r in rows if r is not e8)
    assert len(rows) == 2 and all(r["metrics"]["decode_tok_s"] > 0 for r in rows)
    assert 0 <= e8["metrics"]["kl"] < 0.02 < q4["metrics"]["kl"], (e8["metrics"], q4["metrics"])
    assert e8["passed"] and not q4["passed"]
    assert (tmp_path / "o.png").stat().st_size > 10_000
    assert "pick: smollm2-135m q4f16_1e8" in out.stdout


def _pruned_pair(root: Path) -> tuple[Path, Path]:
    """A tiny random model and the same model with its last layer removed (what `compress --drop-layers 1` makes,
    rebuilt with transformers directly)."""
    import transformers

    from tests.support.tiny import _save_tokenizer, make_tiny

    original = make_tiny(root / "original", "llama", tied=True)
    cfg = transformers.LlamaConfig.from_pretrained(root / "original")
    cfg.num_hidden_layers = 1
    pruned = transformers.LlamaForCausalLM(cfg)
    state = {k: v for k, v in original.state_dict().items() if ".layers.1." not in k}
    pruned.load_state_dict(state)
    pruned.save_pretrained(root / "pruned", safe_serialization=True)
    _save_tokenizer(root / "pruned")
    return root / "original", root / "pruned"


def test_a_folder_candidate_takes_its_reference_from_the_table_the_compress_report_or_itself(tmp_path: Path):
    original, pruned = _pruned_pair(tmp_path)
    space = Space(models=(str(pruned), "smollm2-135m"), backends=("edgellm", "llama.cpp"))
    cands, skipped = expand(space, llama_cpp_available=True)
    assert [(c.backend, c.quality_reference) for c in cands] == [  # no report: its own q0f32
        ("edgellm", str(pruned)), ("edgellm", "smollm2-135m"), ("llama.cpp", "smollm2-135m")]
    assert [why for c, why in skipped if c.model == str(pruned)] == ["llama.cpp candidates are catalog models (their "
                                                                     "GGUF)"]
    report = pruned.with_name(pruned.name + ".report.json")
    report.write_text(json.dumps({"source": str(original), "plan": {}}))
    cands, _ = expand(space, llama_cpp_available=False)
    assert cands[0].quality_reference == str(original) and cands[0].as_dict()["reference"] == str(original)
    cands, _ = expand(Space(models=(str(pruned),), references=((str(pruned), "smollm2-135m"),)),
                      llama_cpp_available=False)
    assert cands[0].quality_reference == "smollm2-135m"  # the table wins over the report
    for body, message in [("{", "not a readable edgellm compress report"),
                          (json.dumps({"source": str(tmp_path / "gone")}), "neither a catalog model nor a path")]:
        report.write_text(body)
        with pytest.raises(EdgeLLMError, match=message):
            expand(Space(models=(str(pruned),)), llama_cpp_available=False)
    with pytest.raises(EdgeLLMError, match="no config.json"):
        expand(Space(models=(str(tmp_path),)), llama_cpp_available=False)


def test_a_folder_candidate_compiles_once_per_content_and_is_measured_against_its_reference(tmp_path: Path,
                                                                                            monkeypatch):
    """The pruned folder's KL is the one `eval quality` gives against the original's own q0f32, not ~0 against
    its own; its artifacts are compiled once and again only when its bytes change."""
    from edgellm.convert.pipeline import convert
    from edgellm.eval.quality import DEFAULT_CORPUS, evaluate_quality, open_scorer
    from edgellm.select.candidates import artifact_for

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    original, pruned = _pruned_pair(tmp_path)
    method = Method(quality_ctx=64, quality_windows=1)
    against = {}
    for reference in ("", str(original)):
        cand = Candidate(str(pruned), "q8f16_1", "edgellm", 1, 256, reference)
        against[reference or "self"] = measure.run_job(Job("quality", cand, method), "dev")
    assert "error" not in against["self"] and "error" not in against[str(original)], against
    assert against["self"]["reference"] == str(pruned) and against[str(original)]["reference"] == str(original)
    assert not against[str(original)]["cached"]  # another reference is another cache entry
    ref = open_scorer(str(convert(original, tmp_path / "orig-f32", quantization="q0f32", progress=False)), threads=1,
                      ctx=64, kv_cache="f32")
    cand = open_scorer(str(convert(pruned, tmp_path / "pruned-q8", quantization="q8f16_1", progress=False)),
                       threads=1, ctx=64)
    want = evaluate_quality(ref, [cand], DEFAULT_CORPUS, ctx=64, max_windows=1).candidates[0]["metrics"]["kl_mean"]
    cand.close()
    ref.close()
    assert against[str(original)]["kl"] == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert against[str(original)]["kl"] > 100 * against["self"]["kl"] and want > 1e-3
    first = artifact_for(str(pruned), "q8f16_1")
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert artifact_for(str(pruned), "q8f16_1") == first and (first / "manifest.json").stat().st_mtime_ns == stamp
    weights = pruned / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # the last weights' bytes change: the candidate is other weights now
    weights.write_bytes(bytes(data))
    assert artifact_for(str(pruned), "q8f16_1") != first
