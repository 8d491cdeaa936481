"""Weights mapped vs moved into huge pages (EDGELLM_HUGE_PAGES=off vs the default, background), alternated in
fresh processes:
load seconds, decode and prefill tokens per second, peak and final resident memory, where the weights ended up.

    python scripts/huge_pages_ab.py qwen2.5-coder-0.5b q4f16_1 --threads 1 --rounds 3

Each round starts one process per mode, in alternating order; each process loads the model, then runs a
512-token prompt + 128 greedy tokens `--requests` times and reports the medians of all but the first (a warm-up,
during which the background move finishes) and where the weights ended up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MODES = ("off", "background")
_CHILD = r"""
import json, os, re, statistics, sys, time
from edgellm.bench.backends import PROMPT_TEXT, fixed_ids
from edgellm.generation import GenerationParams
from edgellm.runtime.engine import Engine
model, scheme, threads, requests = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
engine = Engine.load(model, quantization=scheme, threads=threads, progress=False, context_window=1024)
load_s = time.perf_counter() - t0
ids = fixed_ids(engine.tokenizer.encode, PROMPT_TEXT, 512)
decode, prefill = [], []
for _ in range(requests):
    engine.reset()
    stats = engine.generate(ids, GenerationParams(max_tokens=128, temperature=0.0, ignore_eos=True)).stats
    decode.append((stats.completion_tokens - 1) / stats.decode_s)
    prefill.append(stats.prompt_tokens / stats.prefill_s)
status = open("/proc/self/status").read()
rss = {k: int(re.search(k + r":\s+(\d+)", status).group(1)) / 1024 for k in ("VmHWM", "VmRSS")}
print(json.dumps({"load_s": load_s, "decode": statistics.median(decode[1:]), "prefill": statistics.median(prefill[1:]),
                  "peak_mib": rss["VmHWM"], "end_mib": rss["VmRSS"], "weights": engine.huge_pages.describe()}))
"""


def run(model: str, scheme: str, threads: int, requests: int, mode: str) -> dict:
    env = {**os.environ, "EDGELLM_HUGE_PAGES": mode}
    out = subprocess.run([sys.executable, "-c", _CHILD, model, scheme, str(threads), str(requests)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("scheme")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4, help="requests per process, the first a warm-up")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            result = run(args.model, args.scheme, args.threads, args.requests, mode)
            results[mode].append(result)
            print(f"round {r + 1} {mode:>10}: load {result['load_s']:.2f} s, decode {result['decode']:.1f} tok/s, "
                  f"prefill {result['prefill']:.0f} tok/s, peak {result['peak_mib']:.0f} MiB, "
                  f"end {result['end_mib']:.0f} MiB; {result['weights']}", flush=True)
    med = {mode: {k: statistics.median(x[k] for x in rs) for k in ("load_s", "decode", "prefill", "peak_mib")}
           for mode, rs in results.items()}
    moved, mapped = med["background"], med["off"]
    print(f"median of {args.rounds} rounds, background / off: decode {moved['decode'] / mapped['decode']:.3f}x, "
          f"prefill {moved['prefill'] / mapped['prefill']:.3f}x, load {moved['load_s']:.2f} / {mapped['load_s']:.2f} s, "
          f"peak {moved['peak_mib']:.0f} / {mapped['peak_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
