"""Summary statistics computed from raw samples: median, p10/p90, min–max, spread, derived per-run figures."""

from __future__ import annotations

import math
from typing import Any, Sequence

# A metric whose p10–p90 band is wider than this share of its median gets a stability warning.
STABILITY_LIMIT = 0.10


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    """n, median, p10, p90, min, max and spread (p90−p10)/median; None for no values."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    median = percentile(vals, 50)
    p10, p90 = percentile(vals, 10), percentile(vals, 90)
    return {
        "n": len(vals),
        "median": median,
        "p10": p10,
        "p90": p90,
        "min": min(vals),
        "max": max(vals),
        "spread": (p90 - p10) / median if median else 0.0,
    }


def derive(sample: dict[str, Any]) -> dict[str, Any]:
    """Per-run figures from one raw sample: ms, tokens/s, inter-token latencies."""
    times = sample["token_times_s"]
    gen = len(times)
    decode_s = times[-1] - times[0] if gen > 1 else 0.0
    itl = [b - a for a, b in zip(times, times[1:])]
    energy = sample.get("energy_j")
    return {
        "gen_tokens": gen,
        "ttft_ms": sample["ttft_s"] * 1000.0,
        "prefill_tok_s": sample["prompt_tokens"] / sample["prefill_s"] if sample["prefill_s"] > 0 else 0.0,
        "decode_tok_s": (gen - 1) / decode_s if decode_s > 0 else 0.0,
        "itl_ms": [x * 1000.0 for x in itl],
        "energy_mj_per_token": energy * 1000.0 / gen if energy is not None and gen else None,
    }


SAMPLE_METRICS = ("ttft_ms", "prefill_tok_s", "decode_tok_s", "energy_mj_per_token", "temperature_c")
STABILITY_METRICS = ("ttft_ms", "prefill_tok_s", "decode_tok_s")


def summarize_samples(samples: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """Summaries over the counted samples only, pooled inter-token latency, and stability warnings."""
    counted = [s for s in samples if s["counted"]]
    summary: dict[str, Any] = {}
    for metric in SAMPLE_METRICS:
        summary[metric] = summarize([s[metric] for s in counted if s.get(metric) is not None])
    pooled = [x for s in counted for x in s["itl_ms"]]
    summary["itl_ms"] = summarize(pooled)
    if summary["itl_ms"] is not None:
        summary["itl_ms"]["p50"] = summary["itl_ms"]["median"]
    warnings = []
    for metric in STABILITY_METRICS:
        s = summary[metric]
        if s is not None and s["spread"] > STABILITY_LIMIT:
            warnings.append(f"{metric}: p10–p90 spread is {100 * s['spread']:.0f}% of the median "
                            f"(over {100 * STABILITY_LIMIT:.0f}%); the machine was not quiet — rerun or add runs")
    return summary, warnings
