"""Time the native decode step's attention alone (scripts/attention_bench.c), per kernel variant, for the
decoder/decode.c of this checkout and optionally of an older commit (one with csrc/ split by role), runs
alternated:

    python scripts/attention_bench.py --positions 600 --against fc3e752

Prints the best of each side's runs in ms per token (Qwen2.5-0.5B's shapes, half-precision cache).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from edgellm.kernels.build import CSRC, find_compiler, variants_for

HARNESS = Path(__file__).resolve().parent / "attention_bench.c"


def compile_harness(cc: str, csrc: Path, flags: tuple[str, ...], out: Path) -> None:
    """The harness with ``csrc``'s decoder/decode.c included and its other sources linked."""
    others = [str(p) for p in sorted(csrc.rglob("*.c")) if p.relative_to(csrc).as_posix() != "decoder/decode.c"]
    subprocess.run([cc, "-O3", "-std=c11", "-pthread", *flags, f"-I{csrc}", "-o", str(out), str(HARNESS), *others, "-lm"],
                   check=True, capture_output=True, text=True)


def checkout_csrc(rev: str, into: Path) -> Path:
    """The kernel sources as they were at git revision ``rev``."""
    into.mkdir(parents=True)
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", f"{rev}:edgellm/kernels/csrc"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_bytes(subprocess.run(["git", "show", f"{rev}:edgellm/kernels/csrc/{name}"], check=True,
                                                 capture_output=True).stdout)
    return into


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, default=600, help="cache positions attended over (default 600)")
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds per side (default 5)")
    ap.add_argument("--variant", action="append", help="kernel variant(s) (default: every x86/ARM one this CPU runs)")
    ap.add_argument("--against", metavar="REV", help="also time decoder/decode.c as of this git revision")
    args = ap.parse_args()
    cc = find_compiler()
    if cc is None:
        print("attention_bench: no C compiler found", file=sys.stderr)
        return 1
    from edgellm.kernels import native

    variants = [v for v in variants_for() if (args.variant and v.name in args.variant)
                or (not args.variant and v.name != "scalar" and native.verdict(v.name) is None)]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this checkout": CSRC}
        if args.against:
            trees[args.against] = checkout_csrc(args.against, Path(tmp) / "against")
        for v in variants:
            exes = {}
            for label, csrc in trees.items():
                exes[label] = Path(tmp) / f"{v.name}-{len(exes)}"
                compile_harness(cc, csrc, v.flags, exes[label])
            best = {label: float("inf") for label in exes}
            for _ in range(args.rounds):
                for label, exe in exes.items():
                    ms = float(subprocess.run([str(exe), str(args.positions), "50"], check=True, capture_output=True,
                                              text=True).stdout)
                    best[label] = min(best[label], ms)
            print(f"{v.name:8} " + "  ".join(f"{label}: {ms:.3f} ms" for label, ms in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
