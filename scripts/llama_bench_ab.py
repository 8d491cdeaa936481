"""edgellm against llama.cpp's own `llama-bench` on the same GGUF file, alternated A/B in rounds.

    python scripts/llama_bench_ab.py --llama-bench PATH/llama-bench --threads 1,2 --rounds 3 \
        -o /tmp/ab.json ART_DIR=FILE.gguf [ART_DIR2=FILE2.gguf ...]

ART_DIR is the edgellm artifact made from FILE (`edgellm convert FILE -q source -o ART_DIR`, the same blocks).
Per round, model and thread count it runs A then B (B then A in odd rounds), each a fresh process:
  A  `edgellm bench ART_DIR --backends edgellm -t T --prompt-tokens P --gen-tokens G --warmup 1 --runs R`
     (its report's medians: prefill and decode tok/s, the worker's peak RSS, decode as a share of the roofline)
  B  `/usr/bin/time -v llama-bench -m FILE -t T -p P -n 0 -r R -o json`, then the same with `-p 0 -n G -d P`
     (its mean tok/s per test; the larger peak RSS the kernel accounted for the two processes). The decode test
     runs at depth P, after a P-token context, as edgellm's decode does: llama-bench's plain `-n G` decodes from
     an empty context, which reads no KV cache and is faster than decoding after the prompt.
and prints, per model and thread count, each side's median over the rounds and the median of the per-round
ratios A/B, with the load average (1 minute) seen before each run. Nothing here judges the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FIGURES = ("prefill_tok_s", "decode_tok_s", "peak_rss_mib")


def run_edgellm(artifact: Path, threads: int, args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    """One `edgellm bench` process on the artifact: its headline medians."""
    prefix = scratch / f"edgellm-{artifact.name}-t{threads}"
    cmd = [args.edgellm, "bench", str(artifact), "--backends", "edgellm", "-t", str(threads),
           "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
           "--warmup", "1", "--runs", str(args.runs), "--cold-loads", "1", "-o", str(prefix), "--quiet"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(Path(f"{prefix}.json").read_text())
    (cell,) = report["cells"]
    summary = cell["summary"]
    return {"prefill_tok_s": summary["prefill_tok_s"]["median"], "decode_tok_s": summary["decode_tok_s"]["median"],
            "peak_rss_mib": cell["memory"]["peak_rss_bytes"] / 2**20,
            "roofline_pct": cell["roofline"]["percent_of_limit"]}


def run_llama_bench(gguf: Path, threads: int, args: argparse.Namespace) -> dict[str, float]:
    """Two `llama-bench` processes on the file under /usr/bin/time -v: prefill of P tokens, then decode of G tokens
    at depth P; their mean tok/s and the larger peak RSS."""
    def one(extra: list[str]) -> tuple[dict[str, Any], float]:
        cmd = ["/usr/bin/time", "-v", args.llama_bench, "-m", str(gguf), "-t", str(threads), "-r", str(args.runs),
               "-o", "json", *extra]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rss_kib = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
        if rss_kib is None:
            raise SystemExit("/usr/bin/time -v printed no maximum resident set size")
        (test,) = json.loads(done.stdout)
        return test, int(rss_kib.group(1)) / 1024

    pp, rss_pp = one(["-p", str(args.prompt_tokens), "-n", "0"])
    tg, rss_tg = one(["-p", "0", "-n", str(args.gen_tokens), "-d", str(args.prompt_tokens)])
    return {"prefill_tok_s": pp["avg_ts"], "decode_tok_s": tg["avg_ts"], "peak_rss_mib": max(rss_pp, rss_tg)}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and thread count: medians of each side and of the per-round ratios edgellm / llama.cpp."""
    out = []
    keys = sorted({(r["model"], r["threads"]) for r in rows})
    for model, threads in keys:
        mine = [r for r in rows if (r["model"], r["threads"]) == (model, threads)]
        entry: dict[str, Any] = {"model": model, "threads": threads, "rounds": len(mine),
                                 "load_1min": [r["load_edgellm"] for r in mine] + [r["load_llama"] for r in mine]}
        for fig in FIGURES:
            entry[fig] = {
                "edgellm": statistics.median(r["edgellm"][fig] for r in mine),
                "llama.cpp": statistics.median(r["llama.cpp"][fig] for r in mine),
                "ratio_median": statistics.median(r["edgellm"][fig] / r["llama.cpp"][fig] for r in mine),
                "ratio_range": [min(r["edgellm"][fig] / r["llama.cpp"][fig] for r in mine),
                                max(r["edgellm"][fig] / r["llama.cpp"][fig] for r in mine)],
            }
        entry["roofline_pct_edgellm"] = statistics.median(r["edgellm"]["roofline_pct"] for r in mine)
        out.append(entry)
    return out


def table(summary: list[dict[str, Any]]) -> str:
    lines = ["| model | threads | prefill tok/s edgellm / llama.cpp (ratio, range) | decode tok/s edgellm / "
             "llama.cpp (ratio, range) | peak RSS MiB edgellm / llama.cpp (ratio) | edgellm roofline | load 1-min |",
             "|---|---:|---|---|---|---:|---|"]
    for e in summary:
        cells = []
        for fig, fmt in (("prefill_tok_s", "{:.1f}"), ("decode_tok_s", "{:.1f}"), ("peak_rss_mib", "{:.0f}")):
            f = e[fig]
            lo, hi = f["ratio_range"]
            cells.append(f"{fmt.format(f['edgellm'])} / {fmt.format(f['llama.cpp'])} "
                         f"(**{f['ratio_median']:.2f}×**, {lo:.2f}–{hi:.2f})")
        loads = e["load_1min"]
        lines.append(f"| {e['model']} | {e['threads']} | {' | '.join(cells)} | {e['roofline_pct_edgellm']:.0f}% | "
                     f"{min(loads):.2f}–{max(loads):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pairs", nargs="+", metavar="ART_DIR=FILE.gguf")
    p.add_argument("--llama-bench", required=True, metavar="PATH")
    p.add_argument("--edgellm", default="edgellm", metavar="PATH")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=3, help="counted runs inside each process (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("-o", "--output", type=Path, required=True, metavar="FILE.json")
    args = p.parse_args(argv)
    pairs = []
    for pair in args.pairs:
        art, sep, gguf = pair.partition("=")
        if not sep or not Path(art).is_dir() or not Path(gguf).is_file():
            p.error(f"{pair!r} is not ART_DIR=FILE.gguf with both present")
        pairs.append((Path(art), Path(gguf)))
    threads = [int(t) for t in args.threads.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llama-bench-ab-") as tmp:
        for round_no in range(args.rounds):
            for art, gguf in pairs:
                for t in threads:
                    if round_no % 2 == 0:  # A then B in even rounds, B then A in odd ones
                        load_a = os.getloadavg()[0]
                        a = run_edgellm(art, t, args, Path(tmp))
                    load_b = os.getloadavg()[0]
                    b = run_llama_bench(gguf, t, args)
                    if round_no % 2 == 1:
                        load_a = os.getloadavg()[0]
                        a = run_edgellm(art, t, args, Path(tmp))
                    rows.append({"round": round_no, "model": gguf.name, "threads": t, "edgellm": a, "llama.cpp": b,
                                 "load_edgellm": load_a, "load_llama": load_b})
                    print(f"round {round_no} {gguf.name} t{t}: decode {a['decode_tok_s']:.1f} / "
                          f"{b['decode_tok_s']:.1f}, prefill {a['prefill_tok_s']:.1f} / {b['prefill_tok_s']:.1f}, "
                          f"load {load_a:.2f}/{load_b:.2f}", file=sys.stderr, flush=True)
                    args.output.write_text(json.dumps({"argv": sys.argv, "rows": rows,
                                                       "summary": summarize(rows)}, indent=1))
    print(table(summarize(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
