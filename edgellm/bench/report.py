"""Report output: a terminal table, the JSON file (raw samples + configuration), a PNG chart, and the
difference between two saved runs (`edgellm bench --compare a.json b.json`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgellm.bench.runner import RATIO_METRICS, SCHEMA_VERSION, headline
from edgellm.errors import EdgeLLMError

_RATIO_NAMES = {
    "prefill_tok_s": "prefill tok/s", "decode_tok_s": "decode tok/s", "ttft_ms": "TTFT", "itl_p50_ms": "ITL p50",
    "itl_p90_ms": "ITL p90", "load_cold_s": "load cold", "load_warm_s": "load warm", "peak_rss_mib": "peak RSS",
}


def _f(value: float | None, fmt: str = ".1f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _span(s: dict[str, float] | None, fmt: str = ".1f") -> str:
    return "n/a" if s is None else f"{s['median']:{fmt}} (p90 {s['p90']:{fmt}}, {s['min']:{fmt}}–{s['max']:{fmt}})"


def _bandwidth_line(sys_: dict[str, Any]) -> str:
    """The roofline's bandwidth per thread count (reports before the read probe had a copy test only)."""
    if "bandwidth_gb_s" not in sys_:
        return "copy bandwidth: " + ", ".join(f"{t} thread(s) {b:.1f} GB/s" for t, b in sys_["copy_bandwidth_gb_s"].items())
    probes = sys_["bandwidth_probes_gb_s"]
    series = lambda t, kind: "/".join(format(p[kind], ".1f") for p in probes[t])  # noqa: E731
    return "memory bandwidth (highest copy or read probe, one probe before each group): " + ", ".join(
        f"{t} thread(s) {b:.1f} GB/s (copy {series(t, 'copy')}, read {series(t, 'read')})"
        for t, b in sys_["bandwidth_gb_s"].items())


def format_report(report: dict[str, Any]) -> str:
    """The human-readable summary printed after a run."""
    cfg, sys_ = report["config"], report["system"]
    lines = [
        f"edgellm bench: pp{cfg['prompt_tokens']} tg{cfg['gen_tokens']}, {cfg['warmup']} warm-up + {cfg['runs']} "
        f"counted runs per configuration, backends alternated | {sys_['cpu_model']}, {sys_['cores_available']} cores, "
        f"torch {sys_['versions']['torch']}, llama-cpp-python {sys_['versions']['llama_cpp_python'] or 'not installed'}",
        _bandwidth_line(sys_),
        "edgellm matmul kernel: {name} ({why})".format(**sys_.get("edgellm_kernel", {"name": "?", "why": "not recorded"})),
        "",
    ]
    head = (f"{'configuration':<40} {'bits/p':>6} {'load c/w s':>11} {'TTFT ms':>24} {'prefill tok/s':>26} "
            f"{'decode tok/s':>24} {'ITL p50/p90 ms':>15} {'peak RSS':>9} {'roofline':>8}")
    lines += [head, "-" * len(head)]
    for c in report["cells"]:
        s, h = c["summary"], headline(c)
        lines.append(
            f"{c['label']:<40} {c['artifact']['bits_per_parameter']:>6.2f} "
            f"{c['load']['cold_s']:>5.2f}/{c['load']['warm_s']:<5.2f} {_span(s['ttft_ms'], '.0f'):>24} "
            f"{_span(s['prefill_tok_s']):>26} {_span(s['decode_tok_s']):>24} "
            f"{_f(h['itl_p50_ms'])}/{_f(h['itl_p90_ms']):<9} {h['peak_rss_mib']:>5.0f} MiB {h['roofline_pct']:>7.1f}%")
    colds = report["config"].get("cold_loads", 1)  # reports before --cold-loads took one
    lines.append("(median (p90, min–max) over counted runs; ITL pooled over counted runs; roofline = decode tok/s as "
                 "a share of bandwidth / weight bytes per token; load cold = "
                 + (f"median of {colds} first loads in fresh processes)" if colds > 1 else "first load in a fresh process)"))
    for c in report["cells"]:
        first: dict[str, Any] = next((x for x in c["samples"] if x["counted"]), {})
        if first.get("weights"):
            lines.append(f"weights at the first counted run: {c['label']}: {first['weights']}")
    energy = [c for c in report["cells"] if c["energy_available"]]
    lines.append("energy: " + (", ".join(f"{c['label']} {_f(c['summary']['energy_mj_per_token']['median'])} mJ/token"
                                         for c in energy) if energy else "unavailable on this platform (no RAPL)"))
    temps = [c for c in report["cells"] if c["temperature_available"]]
    lines.append("temperature: " + (", ".join(f"{c['label']} max {c['summary']['temperature_c']['max']:.0f} °C"
                                              for c in temps) if temps else "unavailable (no thermal zones)"))
    if report["comparisons"]:
        lines += ["", "edgellm / llama.cpp (same run, alternating; >1 is edgellm higher — better for tok/s, worse "
                      "for ms, s, MiB):"]
        for comp in report["comparisons"]:
            ratios = "  ".join(f"{_RATIO_NAMES[m]} {_f(comp['ratios'][m], '.2f')}x" for m in RATIO_METRICS)
            lines.append(f"  {comp['edgellm']:<34} {ratios}")
    if report["json_overhead"]:
        lines += ["", "JSON Schema constraint (edgellm, same run, alternating with the plain configuration):"]
        for j in report["json_overhead"]:
            lines.append(f"  {j['json']:<34} decode {_f(j['decode_ms_per_token']['json'], '.2f')} vs "
                         f"{_f(j['decode_ms_per_token']['plain'], '.2f')} ms/token ({_f(j['decode_overhead_pct'], '+.0f')}%), "
                         f"TTFT {_f(j['ttft_ms']['json'], '.0f')} vs {_f(j['ttft_ms']['plain'], '.0f')} ms "
                         f"({_f(j['ttft_overhead_pct'], '+.0f')}%), {j['json_complete_runs']}/{j['json_counted_runs']} "
                         f"runs complete JSON, median {j['json_gen_tokens_median']} tokens")
    lines += ["", "per-stage latency of one end-to-end request (after warm-up; ms):",
              f"  {'configuration':<40} {'load':>8} {'template':>9} {'tokenize':>9} {'prefill':>9} {'decode':>9} "
              f"{'detok':>7}"]
    for c in report["cells"]:
        b = c.get("breakdown") or {}
        ms = lambda k: _f(b[k] * 1000, ".1f") if b.get(k) is not None else "n/a"  # noqa: E731
        lines.append(f"  {c['label']:<40} {ms('load_cold_s'):>8} {ms('template_s'):>9} {ms('tokenize_s'):>9} "
                     f"{ms('prefill_s'):>9} {ms('decode_s'):>9} {ms('detokenize_s'):>7}")
    if report["warnings"]:
        lines += ["", "stability warnings:"] + [f"  ! {w}" for w in report["warnings"]]
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def read_json(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise EdgeLLMError(f"cannot read benchmark report {path}: {exc}") from exc
    if not isinstance(report, dict) or report.get("schema_version") != SCHEMA_VERSION or "cells" not in report:
        raise EdgeLLMError(f"{path} is not an edgellm bench report (schema version {SCHEMA_VERSION})")
    return report


def write_png(report: dict[str, Any], path: Path) -> None:
    """Bars per configuration (median) with p10–p90 whiskers for decode tok/s, prefill tok/s and TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    panels = [("decode_tok_s", "decode tokens/s"), ("prefill_tok_s", "prefill tokens/s"), ("ttft_ms", "TTFT ms")]
    colors = {"edgellm": "#2b7bba", "llama.cpp": "#e07b39"}
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 0.55 * len(cells) + 2), 10), squeeze=False)
    xs = list(range(len(cells)))
    for ax, (metric, title) in zip(axes[:, 0], panels):
        meds, lo, hi = [], [], []
        for c in cells:
            s = c["summary"][metric]
            meds.append(s["median"] if s else 0.0)
            lo.append(s["median"] - s["p10"] if s else 0.0)
            hi.append(s["p90"] - s["median"] if s else 0.0)
        ax.bar(xs, meds, yerr=[lo, hi], capsize=3, color=[colors.get(c["backend"], "#888888") for c in cells])
        ax.set_title(f"{title} (median, whiskers p10–p90)", fontsize=9)
        ax.set_xticks(xs)
        ax.set_xticklabels([c["label"] for c in cells], rotation=35, ha="right", fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    from matplotlib.patches import Patch

    used = sorted({c["backend"] for c in cells})
    axes[0, 0].legend(handles=[Patch(color=colors.get(b, "#888888"), label=b) for b in used], fontsize=8)
    cfg = report["config"]
    fig.suptitle(f"edgellm bench pp{cfg['prompt_tokens']} tg{cfg['gen_tokens']} — {report['system']['cpu_model']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _key(cell: dict[str, Any]) -> tuple[Any, ...]:
    return (cell["backend"], cell["model"], cell["quantization"], cell["threads"], cell["depth"], cell["json_schema"])


def compare_reports(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Change from run A to run B for every configuration present in both (medians)."""
    lines = []
    for what in ("prompt_tokens", "gen_tokens"):
        if a["config"][what] != b["config"][what]:
            lines.append(f"note: {what} differs ({a['config'][what]} vs {b['config'][what]}); figures are not like for like")
    if a["system"]["cpu_model"] != b["system"]["cpu_model"]:
        lines.append(f"note: different CPUs ({a['system']['cpu_model']} vs {b['system']['cpu_model']})")
    metrics = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "itl_p50_ms", "peak_rss_mib")
    lines.append(f"{'configuration':<40} " + " ".join(f"{_RATIO_NAMES[m]:>26}" for m in metrics))
    cells_b = {_key(c): c for c in b["cells"]}
    matched = 0
    for ca in a["cells"]:
        cb = cells_b.pop(_key(ca), None)
        if cb is None:
            lines.append(f"{ca['label']:<40} only in A")
            continue
        matched += 1
        ha, hb = headline(ca), headline(cb)
        cols = []
        for m in metrics:
            x, y = ha[m], hb[m]
            change = f"{100 * (y / x - 1):+.1f}%" if x and y is not None else "n/a"
            cols.append(f"{_f(x)} → {_f(y)} ({change})".rjust(26))
        lines.append(f"{ca['label']:<40} " + " ".join(cols))
    lines += [f"{c['label']:<40} only in B" for c in cells_b.values()]
    if not matched:
        lines.append("no configuration appears in both reports")
    return "\n".join(lines)
