"""Measuring a candidate with the existing bench and eval code, and a cache of every result.

Three kinds of job: `speed` (one bench cell, alone on the machine: TTFT median/p90, decode and prefill
tok/s, peak memory, load time), `quality` (eval quality vs the reference's q0f32 on the same windows: KL,
PPL ratio, top-1; the reference is the model itself, or what a compressed model came from) and `task` (eval
task, constrained mode: valid / complete / correct rates). Quality and task rates depend only on the weights,
so they are shared by every thread count and context.

A result is cached under $EDGELLM_HOME/select/cache keyed by the job's inputs: the hash of the weights
(artifact manifest or GGUF sha256; for quality, the reference's too), the method settings, and the edgellm
version. A rerun measures only what changed; a failed job is a result too (its reason), so it is not retried
until something changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from edgellm.errors import EdgeLLMError
from edgellm.select.candidates import (RECIPE_PREFIX, Candidate, artifact_for, local_source, reference_fingerprint,
                                       weights_fingerprint)
from edgellm.select.constraints import Method

Kind = Literal["speed", "quality", "task"]


@dataclass(frozen=True)
class Job:
    kind: Kind
    candidate: Candidate
    method: Method

    def settings(self) -> dict[str, Any]:
        m = self.method
        if self.kind == "speed":
            return {"threads": self.candidate.threads, "context": self.candidate.context,
                    "prompt_tokens": m.prompt_tokens, "gen_tokens": m.gen_tokens, "warmup": m.warmup, "runs": m.runs}
        if self.kind == "quality":
            return {"quality_ctx": m.quality_ctx, "quality_windows": m.quality_windows}
        return {"task_items": m.task_items}


def cache_dir() -> Path:
    from edgellm.paths import edgellm_home

    return edgellm_home() / "select" / "cache"


def cache_key(job: Job, device_class: str) -> str:
    """The job's identity: what it measures, on which weights, how, with which edgellm, on which device class."""
    from edgellm import __version__

    ident = {"kind": job.kind, "backend": job.candidate.backend, "weights": weights_fingerprint(job.candidate),
             "settings": job.settings(), "edgellm": __version__, "device_class": device_class}
    if job.kind == "quality":
        ident["reference"] = reference_fingerprint(job.candidate)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def read_cached(key: str) -> dict[str, Any] | None:
    path = cache_dir() / f"{key}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_cached(key: str, result: dict[str, Any]) -> None:
    """Atomically: an interrupted run never leaves a half-written result that would be trusted."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(tmp, folder / f"{key}.json")


def _model_arg(cand: Candidate) -> tuple[str, str | None]:
    """(model, quantization) as the bench worker takes them."""
    if cand.backend == "llama.cpp":
        return cand.model, None
    if cand.scheme.startswith(RECIPE_PREFIX) or local_source(cand.model) is not None:
        return str(artifact_for(cand.model, cand.scheme)), None
    return cand.model, cand.scheme


def measure_speed(job: Job) -> dict[str, Any]:
    from edgellm.bench.runner import BenchConfig, CellSpec, headline, measure_cell

    cand, m = job.candidate, job.method
    model, quant = _model_arg(cand)
    config = BenchConfig(models=[model], quantizations=[quant], threads=[cand.threads], backends=[cand.backend],
                         prompt_tokens=m.prompt_tokens, gen_tokens=m.gen_tokens, warmup=m.warmup, runs=m.runs,
                         cold_loads=1)  # one process per candidate: its load time is that one first load
    if m.prompt_tokens + m.gen_tokens + 1 > cand.context:
        raise EdgeLLMError(f"prompt {m.prompt_tokens} + {m.gen_tokens} generated tokens do not fit context {cand.context}")
    cell = measure_cell(CellSpec(cand.backend, model, quant, cand.threads, 0), config, n_ctx=cand.context)
    head = headline(cell)
    ttft = cell["summary"].get("ttft_ms") or {}
    return {"ttft_p90_ms": ttft.get("p90"), "ttft_ms": head["ttft_ms"], "decode_tok_s": head["decode_tok_s"],
            "prefill_tok_s": head["prefill_tok_s"], "peak_memory_mib": head["peak_rss_mib"],
            "load_s": head["load_cold_s"], "warnings": cell["warnings"]}


def measure_quality(job: Job) -> dict[str, Any]:
    from edgellm.bench.backends import gguf_path
    from edgellm.eval.quality import DEFAULT_CORPUS, evaluate_quality, open_scorer

    cand, m = job.candidate, job.method
    reference = open_scorer(str(artifact_for(cand.quality_reference, "q0f32")), threads=1, ctx=m.quality_ctx,
                            kv_cache="f32")
    target = gguf_path(cand.model) if cand.backend == "llama.cpp" else artifact_for(cand.model, cand.scheme)
    scorer = open_scorer(str(target), threads=1, ctx=m.quality_ctx)
    try:
        result = evaluate_quality(reference, [scorer], DEFAULT_CORPUS, ctx=m.quality_ctx,
                                  max_windows=m.quality_windows)
    finally:
        scorer.close()
        reference.close()
    metrics = result.candidates[0]["metrics"]
    return {"kl": metrics["kl_mean"], "ppl_ratio": metrics["ppl_ratio"], "top1": 100.0 * metrics["top1_agreement"],
            "scored_tokens": metrics["tokens"], "reference": cand.quality_reference}


def measure_task(job: Job) -> dict[str, Any]:
    from edgellm.eval.tasks import evaluate_tasks, load_dataset
    from edgellm.runtime.engine import Engine

    cand, m = job.candidate, job.method
    if cand.backend != "edgellm":
        raise EdgeLLMError("task rates are measured with edgellm's engine only")
    engine = Engine.load(artifact_for(cand.model, cand.scheme), threads=1, progress=False)
    try:
        report = evaluate_tasks(engine, load_dataset()[: m.task_items], modes=("constrained",))
    finally:
        engine.close()
    rates = report["rates"]
    return {"task_valid_json": rates["constrained.valid_json"],
            "task_fields_complete": rates["constrained.fields_complete"],
            "task_values_correct": rates["constrained.values_correct"], "task_items": m.task_items}


MEASURE = {"speed": measure_speed, "quality": measure_quality, "task": measure_task}


def run_job(job: Job, device_class: str, use_cache: bool = True) -> dict[str, Any]:
    """The job's result (from the cache when its inputs did not change); a failure is a result with `error`."""
    try:
        key = cache_key(job, device_class)
    except EdgeLLMError as exc:  # the weights could not even be built
        return {"kind": job.kind, "error": str(exc), "cached": False}
    if use_cache and (hit := read_cached(key)) is not None:
        return {**hit, "cached": True}
    try:
        result = {"kind": job.kind, **MEASURE[job.kind](job)}
    except EdgeLLMError as exc:
        result = {"kind": job.kind, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a candidate that crashes is a row with its reason
        last = traceback.extract_tb(exc.__traceback__)[-1]
        result = {"kind": job.kind, "error": f"{type(exc).__name__}: {exc} (at {Path(last.filename).name}:{last.lineno})"}
    result["candidate"] = asdict(job.candidate)
    write_cached(key, result)
    return {**result, "cached": False}
