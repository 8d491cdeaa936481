"""Wall time of a constrained `edgellm run` against a plain one, each in a fresh process (docs/structured-output.md,
"Constrained start").

Rounds of: plain, `--json`, a one-token `--regex "(yes|no)"` and a bad regex `--regex "(a"`, alternated within each
round, every one with `--stats` (its grammar time and TTFT are parsed from stderr). `--cold` gives every
constrained run an EDGELLM_HOME of its own (the shared cache's artifacts and sources linked in, its grammar and
tokenizer caches empty), so the run builds what a first use builds. Prints a markdown table and the load average.

    PYTHONPATH=. python scripts/constrained_start_bench.py [--model smollm2-135m] [--rounds 3] [--cold]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgellm.paths import edgellm_home

RUNS = {
    "plain": ["What is the capital of France? Answer in JSON.", "-n", "32"],
    "--json": ["What is the capital of France? Answer in JSON.", "-n", "32", "--json"],
    '--regex "(yes|no)"': ["Yes or no?", "-n", "4", "--regex", "(yes|no)"],
    '--regex "(a" (refused)': ["Yes or no?", "-n", "4", "--regex", "(a"],
}


def run_once(model: str, args: list[str], threads: int, cold: bool) -> tuple[float, str, int]:
    """(wall seconds, the --stats line or the error, exit code) of one fresh `edgellm run`."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="start-bench-") as home:
        if cold:
            for part in ("artifacts", "sources"):
                (Path(home) / part).symlink_to(edgellm_home() / part)
            env["EDGELLM_HOME"] = home
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "edgellm.cli", "run", model, *args, "--threads", str(threads),
                               "--temperature", "0", "--stats", "--quiet"], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("[", "edgellm: error"))]
    return wall, lines[0] if lines else proc.stderr.strip()[-200:], proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cold", action="store_true", help="empty grammar and tokenizer caches for every run")
    args = parser.parse_args()
    walls: dict[str, list[float]] = {name: [] for name in RUNS}
    grammar: dict[str, list[float]] = {name: [] for name in RUNS}
    loads = []
    for r in range(args.rounds):
        loads.append(float(open("/proc/loadavg").read().split()[0]))
        for name, run_args in RUNS.items():
            wall, stats, code = run_once(args.model, run_args, args.threads, args.cold and name != "plain")
            walls[name].append(wall)
            if match := re.search(r"grammar (\d+) ms", stats):
                grammar[name].append(float(match.group(1)))
            print(f"round {r + 1} {name}: {wall:.2f} s, exit {code}: {stats}", file=sys.stderr, flush=True)
    cache = "empty caches (--cold)" if args.cold else "caches on disk"
    print(f"{args.model}, {args.threads} thread(s), {cache}; load average at each round's start: "
          f"{', '.join(f'{x:.1f}' for x in loads)}\n")
    print("| run | wall s, rounds 1..n | median | over plain (median) | `--stats` grammar ms |\n|---|---|---|---|---|")
    plain = statistics.median(walls["plain"])
    for name in RUNS:
        med = statistics.median(walls[name])
        ms = ", ".join(f"{x:.0f}" for x in grammar[name]) or "-"
        print(f"| {name} | {', '.join(f'{x:.2f}' for x in walls[name])} | {med:.2f} | {med - plain:+.2f} s | {ms} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
