"""The decision table as text, JSON and a PNG (latency vs quality, memory as size, failing candidates grey)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from edgellm.select.constraints import METRICS, Constraints
from edgellm.select.decide import Row

COLUMNS = ("ttft_p90_ms", "decode_tok_s", "peak_memory_mib", "kl", "ppl_ratio", "top1", "task_values_correct")


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if abs(value) < 0.1 and value != 0 else f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}"


def table(constraints: Constraints, rows: Sequence[Row], pick: Row | None) -> str:
    """Every candidate, its metrics, each constraint's verdict with the margin, Pareto (P) and the pick (*)."""
    metrics = [m for m in COLUMNS if any(r.metrics.get(m) is not None for r in rows)]
    head = ["", "candidate", *[METRICS[m][1] for m in metrics], *[lim.name for lim in constraints.limits], "result"]
    body = []
    for row in sorted(rows, key=lambda r: (not r.passed, -(r.score or 0.0), r.candidate.id)):
        mark = ("*" if row is pick else "") + ("P" if row.pareto else "")
        checks = [("-" if c.margin is None else f"{'ok' if c.passed else 'FAIL'} {100 * c.margin:+.0f}%")
                  for c in row.checks]
        result = "pass" if row.passed else f"fail: {row.reason()}"
        body.append([mark, row.candidate.id, *[_fmt(row.metrics.get(m)) for m in metrics], *checks, result])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    widths[-1] = 0  # the reason column is not padded
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    notes = [f"quality of {model} is measured against {reference}'s q0f32"
             for model, reference in dict.fromkeys((r.candidate.model, r.candidate.reference) for r in rows)
             if reference]
    return "\n".join([line(head), *(line(r) for r in body), *notes])


def as_json(constraints: Constraints, by_class: dict[str, tuple[list[Row], Row | None, str]]) -> dict[str, Any]:
    return {
        "tool": "edgellm select",
        "constraints": [{"constraint": lim.name, "bound": lim.bound} for lim in constraints.limits],
        "weights": constraints.weights,
        "method": constraints.method.__dict__,
        "device_classes": {
            cls: {"pick": None if pick is None else pick.candidate.id, "reason": reason,
                  "pareto": [r.candidate.id for r in rows if r.pareto], "rows": [r.as_dict() for r in rows]}
            for cls, (rows, pick, reason) in by_class.items()},
    }


def write_json(data: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_png(rows: Sequence[Row], pick: Row | None, path: Path, title: str) -> bool:
    """Decode ms/token (x) vs KL (y, log), marker area ~ peak memory; False when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r, tok_s, kl) for r in rows
              if (tok_s := r.metrics.get("decode_tok_s")) and (kl := r.metrics.get("kl")) is not None]
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(9, 5.5))
    biggest = max((r.metrics.get("peak_memory_mib") or 1.0) for r, _, _ in points)
    for row, tok_s, kl in points:
        x = 1000.0 / tok_s
        y = max(kl, 1e-6)
        size = 40 + 600 * (row.metrics.get("peak_memory_mib") or 0.0) / biggest
        color = ("tab:red" if row is pick else "tab:blue") if row.passed else "lightgrey"
        ax.scatter([x], [y], s=size, color=color, alpha=0.8, edgecolors="black" if row.pareto else "none")
        ax.annotate(row.candidate.id, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points",
                    color="black" if row.passed else "grey")
    xs = [1000.0 / tok_s for _, tok_s, _ in points]
    ax.set_xlim(min(xs) * 0.8, max(xs) * 1.45)  # room for the labels right of the markers
    ax.set_yscale("log")
    ax.set_xlabel("decode latency, ms per token (lower is better)")
    ax.set_ylabel("KL vs the reference's q0f32 (lower is better)")
    ax.set_title(title + "\nmarker area = peak memory; grey = fails a constraint; outlined = Pareto; red = pick",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
