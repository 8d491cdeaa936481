"""The method: one worker process per configuration, cold and warm loads, warm-up runs excluded, counted
runs alternated between the configurations of a group (same model, threads and depth) so machine
drift falls on all of them alike, every raw sample kept. A cold load is the first load in a fresh process,
taken ``cold_loads`` times per configuration (short-lived processes first, alternated, then the measuring
worker's own): one such load swings by 2x on a shared machine, so the report gives their median.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from edgellm.bench.backends import describe, locate
from edgellm.bench.roofline import bandwidth_ceiling, memory_bandwidth, roofline
from edgellm.bench.stats import derive, summarize_samples
from edgellm.bench.system import machine_info, versions
from edgellm.errors import EdgeLLMError
from edgellm.openmp import user_environment

SCHEMA_VERSION = 1
RATIO_METRICS = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "itl_p50_ms", "itl_p90_ms", "load_cold_s",
                 "load_warm_s", "peak_rss_mib")


@dataclass
class BenchConfig:
    """Everything that defines a benchmark run (recorded verbatim in the report)."""

    models: list[str]
    quantizations: list[str | None] = field(default_factory=lambda: [None])
    threads: list[int] = field(default_factory=lambda: [2])
    backends: list[str] = field(default_factory=lambda: ["edgellm"])
    prompt_tokens: int = 512
    gen_tokens: int = 128
    warmup: int = 10
    runs: int = 10
    cold_loads: int = 3
    depths: list[int] = field(default_factory=lambda: [0])
    json_schema: dict[str, Any] | None = None
    json_schema_path: str | None = None

    @property
    def n_ctx(self) -> int:
        """Context allocated by every backend: the longest request, rounded up to 256."""
        need = max(self.depths) + self.prompt_tokens + self.gen_tokens + 1
        return -(-need // 256) * 256

    def validate(self) -> None:
        if self.prompt_tokens < 1 or self.gen_tokens < 2:
            raise EdgeLLMError("--prompt-tokens must be >= 1 and --gen-tokens >= 2 (decode speed needs two tokens)")
        if self.runs < 1 or self.warmup < 0 or self.cold_loads < 1:
            raise EdgeLLMError("--runs and --cold-loads must be >= 1 and --warmup >= 0")
        if any(t < 1 for t in self.threads) or any(d < 0 for d in self.depths):
            raise EdgeLLMError("--threads must be >= 1 and --depth >= 0")


@dataclass
class CellSpec:
    """One measured configuration."""

    backend: str
    model: str
    quantization: str | None
    threads: int
    depth: int
    json_schema: bool = False

    @property
    def label(self) -> str:
        quant = "gguf" if self.backend == "llama.cpp" else (self.quantization or _scheme_of(self.model))
        parts = [self.model.split(":")[0], quant, f"t{self.threads}", self.backend]
        if self.depth:
            parts.append(f"d{self.depth}")
        if self.json_schema:
            parts.append("json")
        return " ".join(parts)


def _scheme_of(model: str) -> str:
    """The scheme `model` loads at: NAME:SCHEME's, a catalog model's default, else "artifact" (a folder's own)."""
    if ":" in model:
        return model.split(":", 1)[1]
    from edgellm.catalog import CATALOG

    entry = CATALOG.get(model)
    return entry.default_scheme if entry is not None else "artifact"


def plan(config: BenchConfig) -> list[list[CellSpec]]:
    """Groups of cells measured together (alternating): one group per model × threads × depth."""
    groups = []
    for model in config.models:
        for threads in config.threads:
            for depth in config.depths:
                group = []
                if "edgellm" in config.backends:
                    for quant in config.quantizations:
                        group.append(CellSpec("edgellm", model, quant, threads, depth))
                        if config.json_schema is not None:
                            group.append(CellSpec("edgellm", model, quant, threads, depth, json_schema=True))
                if "llama.cpp" in config.backends:
                    group.append(CellSpec("llama.cpp", model, None, threads, depth))
                groups.append(group)
    return groups


class WorkerProcess:
    """A running `edgellm.bench.worker` and its request/reply pipe."""

    def __init__(self, spec: CellSpec, location: Path, n_ctx: int) -> None:
        self.spec = spec
        # llama.cpp runs its own OpenMP team: it gets the environment as the user had it (edgellm/openmp.py)
        env = user_environment() if spec.backend == "llama.cpp" else None
        self.proc = subprocess.Popen([sys.executable, "-m", "edgellm.bench.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, text=True, env=env)
        self.call(op="init", backend=spec.backend, location=str(location), threads=spec.threads, n_ctx=n_ctx)

    def call(self, **msg: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise EdgeLLMError(f"benchmark worker for {self.spec.label} exited (code {self.proc.wait()})")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise EdgeLLMError(f"{self.spec.label}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _measure_group(group: list[CellSpec], config: BenchConfig, say: Callable[[str], None],
                   seq: list[int], n_ctx: int | None = None) -> list[dict[str, Any]]:
    workers: list[WorkerProcess] = []
    cells: list[dict[str, Any]] = []
    n_ctx = n_ctx or config.n_ctx
    # compiled or fetched, and described, here: the workers' peak memory is the backends' own
    locations = [locate(spec.backend, spec.model, spec.quantization) for spec in group]
    infos = [describe(spec.backend, location, n_ctx) for spec, location in zip(group, locations)]
    colds = _cold_loads(group, locations, config.cold_loads - 1, n_ctx, say)
    try:
        for spec, location, info, cold_samples in zip(group, locations, infos, colds):
            say(f"  loading {spec.label}")
            w = WorkerProcess(spec, location, n_ctx)
            workers.append(w)
            cold_samples.append(w.call(op="load")["load_s"])  # first load in a fresh process
            warm = w.call(op="load")  # the same again: files and allocator warm
            w.call(op="prepare", prompt_tokens=config.prompt_tokens, depth=spec.depth)
            cells.append({**asdict(spec), "label": spec.label, "artifact": info,
                          "load": {"cold_s": statistics.median(cold_samples), "cold_samples_s": cold_samples,
                                   "warm_s": warm["load_s"], "rss_after_load_bytes": warm["rss_bytes"]},
                          "samples": []})
        total = config.warmup + config.runs
        for i in range(total):
            say(f"  {'warm-up' if i < config.warmup else 'run'} {i + 1}/{total}")
            shift = i % len(workers)  # rotate who goes first, so no configuration always follows another
            for k in list(range(shift, len(workers))) + list(range(shift)):
                w, cell = workers[k], cells[k]
                schema = config.json_schema if w.spec.json_schema else None
                sample = w.call(op="run", gen=config.gen_tokens, schema=schema)["sample"]
                seq[0] += 1
                sample = {"seq": seq[0], "iteration": i, "counted": i >= config.warmup,
                          "wall_clock_utc": time.time(), **sample}
                sample.update(derive(sample))
                cell["samples"].append(sample)
        for w, cell in zip(workers, cells):
            breakdown = w.call(op="breakdown", prompt_tokens=config.prompt_tokens, gen=config.gen_tokens)["breakdown"]
            cell["breakdown"] = {"load_cold_s": cell["load"]["cold_s"], **breakdown}
            mem = w.call(op="memory")
            cell["memory"] = {"peak_rss_bytes": mem["peak_rss_bytes"], "rss_end_bytes": mem["rss_bytes"]}
    finally:
        for w in workers:
            w.close()
    return cells


def _cold_loads(group: list[CellSpec], locations: list[Path], rounds: int, n_ctx: int,
                say: Callable[[str], None]) -> list[list[float]]:
    """Per configuration, the seconds of `rounds` first loads, each in a process of its own that then quits;
    the configurations take turns, the first to go rotating round by round."""
    samples: list[list[float]] = [[] for _ in group]
    for r in range(rounds):
        order = [(r + k) % len(group) for k in range(len(group))]
        for k in order:
            say(f"  cold load {r + 1}/{rounds + 1} of {group[k].label}")
            w = WorkerProcess(group[k], locations[k], n_ctx)
            try:
                samples[k].append(w.call(op="load")["load_s"])
            finally:
                w.close()
    return samples


def _finish_cell(cell: dict[str, Any], bandwidth: dict[int, float]) -> None:
    cell["summary"], cell["warnings"] = summarize_samples(cell["samples"])
    decode = cell["summary"]["decode_tok_s"]
    cell["roofline"] = roofline(decode["median"] if decode else 0.0, cell["artifact"]["weight_bytes_per_token"],
                                bandwidth[cell["threads"]])
    counted = [s for s in cell["samples"] if s["counted"]]
    cell["energy_available"] = any(s["energy_j"] is not None for s in counted)
    cell["temperature_available"] = any(s["temperature_c"] is not None for s in counted)


def measure_cell(spec: CellSpec, config: BenchConfig, *, n_ctx: int | None = None,
                 say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """One configuration measured on its own (same method as a bench group), with its summary and headline."""
    config.validate()
    cell = _measure_group([spec], config, say, [0], n_ctx=n_ctx)[0]
    _finish_cell(cell, {spec.threads: bandwidth_ceiling([memory_bandwidth(spec.threads)])})
    return cell


def headline(cell: dict[str, Any]) -> dict[str, float | None]:
    """The figures compared across backends and runs (medians; pooled inter-token percentiles)."""
    s = cell["summary"]
    med = lambda m: s[m]["median"] if s.get(m) else None  # noqa: E731
    itl = s.get("itl_ms")
    return {
        "prefill_tok_s": med("prefill_tok_s"),
        "decode_tok_s": med("decode_tok_s"),
        "ttft_ms": med("ttft_ms"),
        "itl_p50_ms": itl["median"] if itl else None,
        "itl_p90_ms": itl["p90"] if itl else None,
        "load_cold_s": cell["load"]["cold_s"],
        "load_warm_s": cell["load"]["warm_s"],
        "peak_rss_mib": cell["memory"]["peak_rss_bytes"] / 2**20,
        "roofline_pct": cell["roofline"]["percent_of_limit"],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _overhead_pct(a: float | None, b: float | None) -> float | None:
    """How much more `a` is than `b`, in percent (None unless both are measured and nonzero)."""
    return 100.0 * (a / b - 1) if a and b else None


def comparisons(cells: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """edgellm/llama.cpp ratios per metric within each group, and JSON-constrained vs plain edgellm."""
    vs_llama, json_overhead = [], []
    key = lambda c: (c["model"], c["threads"], c["depth"])  # noqa: E731
    for cell in cells:
        if cell["backend"] != "edgellm":
            continue
        if not cell["json_schema"]:
            for other in cells:
                if other["backend"] == "llama.cpp" and key(other) == key(cell):
                    a, b = headline(cell), headline(other)
                    vs_llama.append({"edgellm": cell["label"], "llama.cpp": other["label"],
                                     "ratios": {m: _ratio(a[m], b[m]) for m in RATIO_METRICS}})
            continue
        for plain in cells:
            if (plain["backend"] == "edgellm" and not plain["json_schema"] and key(plain) == key(cell)
                    and plain["quantization"] == cell["quantization"]):
                a, b = headline(cell), headline(plain)
                per_token_json = 1000.0 / a["decode_tok_s"] if a["decode_tok_s"] else None
                per_token_plain = 1000.0 / b["decode_tok_s"] if b["decode_tok_s"] else None
                counted = [s for s in cell["samples"] if s["counted"]]
                json_overhead.append({
                    "json": cell["label"], "plain": plain["label"],
                    "decode_ms_per_token": {"plain": per_token_plain, "json": per_token_json},
                    "decode_overhead_pct": _overhead_pct(per_token_json, per_token_plain),
                    "ttft_ms": {"plain": b["ttft_ms"], "json": a["ttft_ms"]},
                    "ttft_overhead_pct": _overhead_pct(a["ttft_ms"], b["ttft_ms"]),
                    "json_gen_tokens_median": sorted(s["gen_tokens"] for s in counted)[len(counted) // 2],
                    "json_complete_runs": sum(1 for s in counted if s.get("complete")),
                    "json_counted_runs": len(counted),
                })
    return vs_llama, json_overhead


def run_bench(config: BenchConfig, *, argv: list[str] | None = None,
              say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Measure every configuration and return the full report (raw samples included)."""
    config.validate()
    started = datetime.now(timezone.utc)
    probes: dict[int, list[dict[str, float]]] = {t: [] for t in sorted(set(config.threads))}
    cells: list[dict[str, Any]] = []
    seq = [0]
    groups = plan(config)
    for n, group in enumerate(groups, 1):
        threads = group[0].threads
        say(f"measuring memory bandwidth on {threads} thread(s) (copy and read probes)")
        probes[threads].append(memory_bandwidth(threads))
        say(f"[{n}/{len(groups)}] {group[0].model} threads={threads} depth={group[0].depth}: "
            + ", ".join(spec.label for spec in group))
        for cell in _measure_group(group, config, say, seq):
            cell["group"] = n
            cells.append(cell)
    bandwidth = {t: bandwidth_ceiling(p) for t, p in probes.items()}
    for cell in cells:
        _finish_cell(cell, bandwidth)
    vs_llama, json_overhead = comparisons(cells)
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "edgellm bench",
        "started_utc": started.isoformat(timespec="seconds"),
        "duration_s": (datetime.now(timezone.utc) - started).total_seconds(),
        "command": argv,
        "config": {**{k: v for k, v in asdict(config).items() if k != "json_schema"},
                   "json_schema": config.json_schema, "n_ctx": config.n_ctx},
        "system": {**machine_info(), "versions": versions(),
                   "bandwidth_gb_s": {str(t): b / 1e9 for t, b in bandwidth.items()},
                   "bandwidth_probes_gb_s": {str(t): [{k: v / 1e9 for k, v in p.items()} for p in ps]
                                             for t, ps in probes.items()}},
        "cells": cells,
        "comparisons": vs_llama,
        "json_overhead": json_overhead,
        "warnings": [f"{c['label']}: {w}" for c in cells for w in c["warnings"]],
    }
