"""Eval reports as a terminal table, JSON, and a PNG of quality vs size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def quality_table(result: dict[str, Any]) -> str:
    """One row per candidate: size, perplexities, PPL ratio, KL mean/p99, top-1 agreement, Δp."""
    ref = result["reference"]
    s = result["settings"]
    head = (f"reference {ref['name']} ({ref['size_bytes'] / 2**20:.0f} MiB); {s['windows']} windows of "
            f"{s['ctx']} tokens, second half scored"
            + (" one token at a time (the decode path)" if s.get("path") == "decode" else ""))
    rows = []
    for c in result["candidates"]:
        m = c["metrics"]
        rows.append([c["name"], f"{c['size_bytes'] / 2**20:.1f}", f"{m['ppl_ref']:.3f}", f"{m['ppl_cand']:.3f}",
                     f"{m['ppl_ratio']:.4f}", f"{m['kl_mean']:.5f}", f"{m['kl_p99']:.4f}",
                     f"{100 * m['top1_agreement']:.2f}%", f"{100 * m['delta_p_mean']:+.3f}%",
                     str(m["tokens"])])
    header = ["candidate", "MiB", "PPL ref", "PPL cand", "PPL ratio", "KL mean", "KL p99", "top-1", "mean Δp",
              "tokens"]
    return head + "\n" + _table(header, rows)


def task_table(report: dict[str, Any]) -> str:
    """One row per mode: the three rates; then per-field accuracy."""
    rows = [[mode, str(m["items"]), f"{m['valid_json']:.1f}%", f"{m['fields_complete']:.1f}%",
             f"{m['values_correct']:.1f}%", f"{m['seconds']:.0f}"] for mode, m in report["modes"].items()]
    out = f"{report['model']}\n" + _table(["mode", "items", "valid JSON", "fields complete", "values correct",
                                           "seconds"], rows)
    fields = sorted({f for m in report["modes"].values() for f in m["per_field"]})
    if fields:
        modes = list(report["modes"])
        frows = [[f, *(f"{report['modes'][md]['per_field'].get(f, 0):.0f}%" for md in modes)] for f in fields]
        out += "\n\nper-field accuracy\n" + _table(["field", *modes], frows)
    return out


def write_json(data: Any, path: str | Path) -> Path:
    out = Path(path)
    out.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def quality_png(results: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """KL and top-1 agreement vs size on disk, one line per model (reference marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_top) = plt.subplots(1, 2, figsize=(11, 4.2))
    for result in results:
        cands = sorted(result["candidates"], key=lambda c: c["size_bytes"])
        sizes = [c["size_bytes"] / 2**20 for c in cands]
        label = result["reference"]["name"].rsplit("-", 1)[0]
        ax_kl.plot(sizes, [max(c["metrics"]["kl_mean"], 1e-6) for c in cands], "o", label=label)
        ax_top.plot(sizes, [100 * c["metrics"]["top1_agreement"] for c in cands], "o", label=label)
        for c, x in zip(cands, sizes):
            tag = "llama.cpp GGUF" if c["scheme"] == "gguf" else c["name"].removeprefix(label + "-")
            ax_kl.annotate(tag, (x, max(c["metrics"]["kl_mean"], 1e-6)), fontsize=7,
                           textcoords="offset points", xytext=(4, 2))
            ax_top.annotate(tag, (x, 100 * c["metrics"]["top1_agreement"]), fontsize=7,
                            textcoords="offset points", xytext=(4, 2))
    ax_kl.set_yscale("log")
    for ax in (ax_kl, ax_top):
        ax.set_xscale("log")
    ax_kl.set_xlabel("size on disk (MiB)")
    ax_kl.set_ylabel("mean KL vs q0f32 (nats)")
    ax_top.set_xlabel("size on disk (MiB)")
    ax_top.set_ylabel("top-1 agreement with q0f32 (%)")
    for ax in (ax_kl, ax_top):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("quality vs size per quantization")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
