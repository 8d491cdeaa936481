"""`telemetry report`: P50/P90 of the latency figures per device class × model × version."""

from __future__ import annotations

import calendar
import math
import re
import time
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError

METRICS = ("ttft_ms", "decode_tok_s", "total_ms", "peak_rss_mib")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """``30m``, ``24h``, ``7d`` (ago) or an ISO date ``2026-11-30[THH:MM]`` (UTC) → a unix time."""
    now = time.time() if now is None else now
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d"):
        try:
            return float(calendar.timegm(time.strptime(text.strip(), fmt)))
        except ValueError:
            continue
    raise EdgeLLMError(f"--since takes 30m, 24h, 7d or a date like 2026-11-30, not {text!r}")


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (device class, model, version): counts, error rate, P50/P90 of each metric."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for e in events:
        groups.setdefault((e["device_class"], e["model"], e["version"]), []).append(e)
    rows = []
    for (device, model, version), evs in sorted(groups.items()):
        row: dict[str, Any] = {"device_class": device, "model": model, "version": version, "events": len(evs),
                               "errors": sum(1 for e in evs if e.get("error_class"))}
        for metric in METRICS:
            values = [float(e[metric]) for e in evs if e.get(metric) is not None and not e.get("error_class")]
            for q in (50, 90):
                p = percentile(values, q / 100)
                row[f"{metric}_p{q}"] = None if p is None else round(p, 2)
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    cell = lambda v: "—" if v is None else f"{v:g}"  # noqa: E731
    header = ("device class", "model", "version", "events", "errors", "TTFT ms P50/P90", "decode tok/s P50/P90",
              "total ms P50/P90", "peak MiB P90")
    table = [header] + [(r["device_class"], r["model"], r["version"], str(r["events"]), str(r["errors"]),
                         f"{cell(r['ttft_ms_p50'])} / {cell(r['ttft_ms_p90'])}",
                         f"{cell(r['decode_tok_s_p50'])} / {cell(r['decode_tok_s_p90'])}",
                         f"{cell(r['total_ms_p50'])} / {cell(r['total_ms_p90'])}", cell(r["peak_rss_mib_p90"]))
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


def write_png(rows: list[dict[str, Any]], path: Path) -> Path:
    """TTFT and decode speed, P50 bars with P90 marks, one group per device × model × version."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgeLLMError("--png needs matplotlib: pip install 'edgellm[bench]'") from None
    labels = [f"{r['model']}@{r['version']}\n{r['device_class']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(6, 2.2 * len(rows) + 3), 4.5))
    for ax, metric, title in ((axes[0], "ttft_ms", "time to first token (ms)"),
                              (axes[1], "decode_tok_s", "decode (tokens/s)")):
        p50 = [r[f"{metric}_p50"] or 0 for r in rows]
        p90 = [r[f"{metric}_p90"] or 0 for r in rows]
        xs = range(len(rows))
        ax.bar(xs, p50, color="#4c78a8", label="P50")
        ax.scatter(xs, p90, color="#e45756", marker="_", s=400, linewidths=3, label="P90", zorder=3)
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
