"""`edgellm bench`: the method (warm-ups excluded, counts, statistics from raw samples), the report's
JSON schema, the PNG, --compare, and the unavailable energy/temperature path. No test asserts a speed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edgellm.catalog import get_entry

from edgellm.bench import report as report_mod
from edgellm.bench import system
from edgellm.bench.stats import derive, percentile, summarize, summarize_samples

SCHEMA = Path(__file__).resolve().parents[2] / "edgellm" / "bench" / "example_schema.json"
WARMUP, RUNS, PROMPT, GEN = 2, 3, 16, 8


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm.cli", "bench", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="session")
def bench_run(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> tuple[dict, Path, str]:
    """One real tiny run on the embedded smollm2-135m, plain and JSON-constrained, edgellm only."""
    prefix = tmp_path_factory.mktemp("bench") / "run"
    proc = _bench("smollm2-135m", "--prompt-tokens", str(PROMPT), "--gen-tokens", str(GEN), "--warmup", str(WARMUP),
                  "--runs", str(RUNS), "--threads", "1", "--backends", "edgellm", "--json-schema", str(SCHEMA),
                  "-o", str(prefix))
    assert proc.returncode == 0, proc.stderr
    return json.loads(prefix.with_suffix(".json").read_text()), prefix, proc.stdout


def test_percentiles_match_numpy() -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.5, 2.2, 8.1]
    for q in (0, 10, 50, 90, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    s = summarize(values)
    assert s is not None and s["n"] == 7 and s["min"] == 1.0 and s["max"] == 9.0
    assert s["spread"] == pytest.approx((s["p90"] - s["p10"]) / s["median"])
    assert summarize([]) is None


def test_stability_warning_only_when_spread_is_wide() -> None:
    def sample(decode_gap: float, counted: bool = True) -> dict:
        raw = {"counted": counted, "prompt_tokens": 10, "prefill_s": 0.1, "ttft_s": 0.1,
               "token_times_s": [0.1 + i * decode_gap for i in range(5)], "energy_j": None, "temperature_c": None}
        return {**raw, **derive(raw)}

    _, quiet = summarize_samples([sample(0.01) for _ in range(5)])
    assert quiet == []
    summary, noisy = summarize_samples([sample(g) for g in (0.01, 0.02, 0.01, 0.03, 0.01)])
    assert any(w.startswith("decode_tok_s") for w in noisy)
    # Warm-up samples never enter the summary, however slow they were.
    summary, _ = summarize_samples([sample(5.0, counted=False)] + [sample(0.01) for _ in range(3)])
    assert summary["decode_tok_s"]["n"] == 3 and summary["decode_tok_s"]["min"] == pytest.approx(100.0)


def test_warmups_excluded_and_counts(bench_run: tuple[dict, Path, str]) -> None:
    report, _, _ = bench_run
    assert report["config"]["warmup"] == WARMUP and report["config"]["runs"] == RUNS
    assert [c["json_schema"] for c in report["cells"]] == [False, True]
    for cell in report["cells"]:
        samples = cell["samples"]
        assert len(samples) == WARMUP + RUNS
        assert [s["counted"] for s in samples] == [False] * WARMUP + [True] * RUNS
        assert [s["iteration"] for s in samples] == list(range(WARMUP + RUNS))
        assert cell["summary"]["decode_tok_s"]["n"] == RUNS
        for s in samples:
            assert s["prompt_tokens"] == PROMPT and s["depth_tokens"] == 0
            assert s["token_times_s"] == sorted(s["token_times_s"]) and s["ttft_s"] <= s["token_times_s"][0] + 1e-9
        plain = cell["samples"] if not cell["json_schema"] else []
        assert all(len(s["token_times_s"]) == GEN for s in plain)  # plain runs generate exactly GEN tokens
    # Each edgellm run records where its weights were as it began, and the text report names the first counted one's.
    placed = re.compile(r"mapped \(.+\)|moving into huge pages \(\d+ of \d+ MiB\)|(\d+) of \1 MiB in huge pages \(.+\)")
    assert all(placed.fullmatch(s["weights"]) for c in report["cells"] for s in c["samples"])
    first = next(s for s in report["cells"][0]["samples"] if s["counted"])["weights"]
    assert f"weights at the first counted run: {report['cells'][0]['label']}: {first}" in bench_run[2]
    # The two configurations alternate: within an iteration their sequence numbers are adjacent.
    a, b = (c["samples"] for c in report["cells"])
    for sa, sb in zip(a, b):
        assert sa["iteration"] == sb["iteration"] and abs(sa["seq"] - sb["seq"]) == 1


def test_summary_is_computed_from_raw_counted_samples(bench_run: tuple[dict, Path, str]) -> None:
    report, _, _ = bench_run
    cell = report["cells"][0]
    counted = [s for s in cell["samples"] if s["counted"]]
    decode = [(len(s["token_times_s"]) - 1) / (s["token_times_s"][-1] - s["token_times_s"][0]) for s in counted]
    prefill = [s["prompt_tokens"] / s["prefill_s"] for s in counted]
    itl = [1000 * (b - a) for s in counted for a, b in zip(s["token_times_s"], s["token_times_s"][1:])]
    summ = cell["summary"]
    assert summ["decode_tok_s"]["median"] == pytest.approx(float(np.median(decode)))
    assert summ["decode_tok_s"]["p90"] == pytest.approx(float(np.percentile(decode, 90)))
    assert summ["prefill_tok_s"]["min"] == pytest.approx(min(prefill))
    assert summ["ttft_ms"]["max"] == pytest.approx(1000 * max(s["ttft_s"] for s in counted))
    assert summ["itl_ms"]["n"] == RUNS * (GEN - 1)
    assert summ["itl_ms"]["p50"] == pytest.approx(float(np.percentile(itl, 50)))
    assert summ["itl_ms"]["p90"] == pytest.approx(float(np.percentile(itl, 90)))
    roof = cell["roofline"]
    bw = report["system"]["bandwidth_gb_s"]["1"] * 1e9
    probes = report["system"]["bandwidth_probes_gb_s"]["1"]  # one probe before the one group, both kinds
    assert len(probes) == 1 and bw == pytest.approx(1e9 * max(probes[0]["copy"], probes[0]["read"]))
    assert roof["percent_of_limit"] == pytest.approx(100 * summ["decode_tok_s"]["median"] *
                                                     cell["artifact"]["weight_bytes_per_token"] / bw)


def test_report_json_schema(bench_run: tuple[dict, Path, str]) -> None:
    report, prefix, _ = bench_run
    assert report["schema_version"] == 1 and report["tool"] == "edgellm bench"
    assert report["command"][:3] == ["edgellm", "bench", "smollm2-135m"]
    for key in ("prompt_tokens", "gen_tokens", "warmup", "runs", "threads", "quantizations", "backends", "depths",
                "json_schema", "n_ctx"):
        assert key in report["config"]
    sys_ = report["system"]
    for key in ("cpu_model", "cores_available", "versions", "bandwidth_gb_s", "rapl_available",
                "thermal_available", "edgellm_kernel"):
        assert key in sys_
    kernel = sys_["edgellm_kernel"]
    assert f"edgellm matmul kernel: {kernel['name']} ({kernel['why']})" in bench_run[2]
    assert sys_["versions"]["torch"].startswith("2.")
    for cell in report["cells"]:
        assert cell["backend"] == "edgellm" and cell["threads"] == 1
        assert cell["artifact"]["quantization"] == get_entry("smollm2-135m").default_scheme and 4 < cell["artifact"]["bits_per_parameter"] < 9
        assert cell["load"]["cold_s"] > 0 and cell["load"]["warm_s"] > 0
        cold = cell["load"]["cold_samples_s"]  # --cold-loads' default: three first loads, each in a fresh process
        assert len(cold) == 3 and all(x > 0 for x in cold) and cell["load"]["cold_s"] == sorted(cold)[1]
        assert cell["memory"]["peak_rss_bytes"] >= cell["memory"]["rss_end_bytes"] > 0
        stages = ("load_cold_s", "template_s", "tokenize_s", "prefill_s", "decode_s", "detokenize_s")
        assert all(cell["breakdown"][stage] > 0 for stage in stages), cell["breakdown"]  # each was timed
        for sample in cell["samples"]:
            assert set(sample) >= {"ttft_s", "prefill_s", "token_times_s", "energy_j", "temperature_c", "itl_ms"}
    assert "load cold = median of 3 first loads in fresh processes" in bench_run[2]
    overhead = report["json_overhead"]
    assert len(overhead) == 1 and overhead[0]["json_counted_runs"] == RUNS
    assert report_mod.read_json(prefix.with_suffix(".json"))["cells"][0]["label"] == report["cells"][0]["label"]


def test_png_is_a_valid_image(bench_run: tuple[dict, Path, str]) -> None:
    _, prefix, stdout = bench_run
    png = prefix.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as img:
        img.verify()
    import matplotlib.image

    assert matplotlib.image.imread(png).ndim == 3
    assert "decode tok/s" in stdout and "JSON Schema constraint" in stdout and f"and {png}" in stdout


def test_compare_two_saved_runs(bench_run: tuple[dict, Path, str], tmp_path: Path) -> None:
    report, prefix, _ = bench_run
    faster = json.loads(json.dumps(report))
    cell = faster["cells"][0]
    cell["summary"]["decode_tok_s"]["median"] *= 2
    b = tmp_path / "b.json"
    b.write_text(json.dumps(faster))
    proc = _bench("--compare", str(prefix.with_suffix(".json")), str(b))
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith(cell["label"] + " "))
    assert "+100.0%" in row
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = _bench("--compare", str(bad), str(b))
    assert proc.returncode == 1 and "not an edgellm bench report" in proc.stderr


def test_energy_and_temperature_unavailable_without_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system, "SYSFS_ROOT", tmp_path)
    assert system.rapl_domains() == [] and system.read_temperatures() is None and system.max_temperature() is None
    meter = system.EnergyMeter()
    meter.start()
    assert not meter.available and meter.stop() is None
    info = system.machine_info()
    assert info["rapl_available"] is False and info["thermal_available"] is False


def test_energy_and_temperature_read_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "class" / "powercap" / "intel-rapl:0"
    (pkg / "intel-rapl:0:0").mkdir(parents=True)  # a sub-zone: already counted in the package
    (pkg / "name").write_text("package-0\n")
    (pkg / "max_energy_range_uj").write_text("1000000\n")
    (pkg / "energy_uj").write_text("900000\n")
    (pkg / "intel-rapl:0:0" / "energy_uj").write_text("5\n")
    zone = tmp_path / "class" / "thermal" / "thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("x86_pkg_temp\n")
    (zone / "temp").write_text("47500\n")
    monkeypatch.setattr(system, "SYSFS_ROOT", tmp_path)
    assert [d.name for d in system.rapl_domains()] == ["package-0"]
    meter = system.EnergyMeter()
    meter.start()
    (pkg / "energy_uj").write_text("400000\n")  # wrapped around: 100000 + 400000 µJ
    assert meter.stop() == pytest.approx(0.5)
    assert system.read_temperatures() == {"x86_pkg_temp-0": 47.5}


def test_roofline_bytes_per_token(smollm2_gguf: Path) -> None:
    from edgellm.bench.roofline import artifact_weight_bytes_per_token, gguf_weight_bytes_per_token, roofline
    from edgellm.resolve import resolve_model

    folder = resolve_model("smollm2-135m", progress=False)
    shard_bytes = sum(p.stat().st_size for p in folder.glob("weights-*.safetensors"))
    tied = artifact_weight_bytes_per_token(folder)  # tied embedding: every tensor is read
    assert 0.98 * shard_bytes < tied < shard_bytes
    assert 0.9 * smollm2_gguf.stat().st_size < gguf_weight_bytes_per_token(smollm2_gguf) < smollm2_gguf.stat().st_size
    r = roofline(50.0, 100_000_000, 10e9)
    assert r["limit_tok_s"] == pytest.approx(100.0) and r["percent_of_limit"] == pytest.approx(50.0)


def test_llama_cpp_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from edgellm.bench.backends import locate, make_backend
    from edgellm.errors import EdgeLLMError

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(EdgeLLMError, match=r"pip install -e '\.\[compare\]'"):
        locate("llama.cpp", "smollm2-135m", None)
    with pytest.raises(EdgeLLMError, match=r"pip install -e '\.\[compare\]'"):
        make_backend("llama.cpp", tmp_path / "model.gguf", 1, 256)


def test_a_llama_cpp_worker_holds_only_llama_cpp() -> None:
    """The worker's peak memory is reported as llama.cpp's: it must not import torch (about 220 MiB resident)
    nor read the GGUF's tables in Python (the runner describes the file in its own process)."""
    code = textwrap.dedent("""
        import sys, types
        sys.modules["llama_cpp"] = types.ModuleType("llama_cpp")  # the stand-in: only the worker's own imports count
        from edgellm.bench.worker import Worker
        Worker().handle({"op": "init", "backend": "llama.cpp", "location": "/nonexistent/model.gguf",
                         "threads": 1, "n_ctx": 64})
        print(sorted(m for m in ("torch", "gguf", "transformers", "tokenizers") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bad_arguments_are_one_line_errors() -> None:
    proc = _bench("smollm2-135m", "--gen-tokens", "1")
    assert proc.returncode == 1 and "--gen-tokens" in proc.stderr and "Traceback" not in proc.stderr
    proc = _bench()
    assert proc.returncode == 1 and "MODEL" in proc.stderr
    proc = _bench("smollm2-135m", "--cold-loads", "0")
    assert proc.returncode == 1 and "--cold-loads must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


def test_peak_rss_is_the_processs_own() -> None:
    """A worker started by a big parent reports its own peak, not the parent's (ru_maxrss survives exec)."""
    import torch

    ballast = torch.ones(300 * 2**20 // 4)
    ballast += 1
    code = "from edgellm.bench.system import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert system.peak_rss_bytes() > 300 * 2**20 > child
    del ballast


def test_a_report_from_before_the_read_probe_still_renders() -> None:
    old = report_mod.read_json(Path(__file__).parents[2] / "docs/benchmarks/coldloads3-2026-11-30.json")
    text = report_mod.format_report(old)
    assert "copy bandwidth: 1 thread(s) 35.7 GB/s, 2 thread(s) 43.1 GB/s" in text
    assert "peak RSS 1.00x" in text  # its figures as published (that run's llama.cpp worker had imported torch)


def _cell(label: str, json_schema: bool, ttft_ms: float | None) -> dict:
    summary = {"decode_tok_s": {"median": 100.0 if json_schema else 120.0}, "prefill_tok_s": {"median": 900.0}}
    if ttft_ms is not None:
        summary["ttft_ms"] = {"median": ttft_ms}
    return {"backend": "edgellm", "json_schema": json_schema, "model": "m", "threads": 1, "depth": 0,
            "quantization": "q4f16_1", "label": label, "summary": summary, "load": {"cold_s": 1.0, "warm_s": 0.5},
            "memory": {"peak_rss_bytes": 2**20}, "roofline": {"percent_of_limit": 50.0},
            "samples": [{"counted": True, "gen_tokens": 10, "complete": True}]}


def test_json_overhead_without_a_plain_ttft_is_unmeasured_not_a_crash():
    from edgellm.bench.runner import comparisons

    _, overhead = comparisons([_cell("json", True, 40.0), _cell("plain", False, None)])
    assert overhead[0]["ttft_overhead_pct"] is None
    assert overhead[0]["decode_overhead_pct"] == pytest.approx(100.0 * (10.0 / (1000.0 / 120.0) - 1))
    _, measured = comparisons([_cell("json", True, 40.0), _cell("plain", False, 32.0)])
    assert measured[0]["ttft_overhead_pct"] == pytest.approx(25.0)
