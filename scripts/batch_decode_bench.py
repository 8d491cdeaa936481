"""Tokens/s of the batched native decode step (NativeModel.decode_batch) at M rows per step, each row its own
sequence and KV cache with `--context` prompt tokens already in it, as ratios to M = 1 measured in the same run:
every round times each M once, in a rotated order, and each M's figure is its median over the rounds. One
engine per thread count, loaded up front. With `--libraries A.so B.so`, each M is timed on both builds of the
native library in every round (alternated AB, BA, ...: the decoder swapped on the same model and caches), and B/A
is given per M, with whether both sides decoded the same greedy tokens; `--clock cpu` (one thread) counts the
process's CPU time, robust to a shared machine's time slicing.

    python scripts/batch_decode_bench.py smollm2-135m --rows 1 2 4 8 --threads 1 2 --rounds 5
    python scripts/batch_decode_bench.py MODEL --threads 1 --libraries OLD.so NEW.so --clock cpu
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

from edgellm.bench.backends import PROMPT_TEXT
from edgellm.kernels import abi, native
from edgellm.kernels.decoder import NativeDecoder
from edgellm.runtime.engine import Engine


def rows_per_s(model, caches: list, prompt: list[int], steps: int, clock=time.perf_counter) -> tuple[float, list]:
    """Rows decoded per second (of `clock`) over `steps` batched steps of len(caches) rows, from position
    len(prompt) on, and the greedy tokens of every step."""
    m = len(caches)
    tokens = [prompt[i % len(prompt)] for i in range(m)]
    seen = []
    t0 = clock()
    for s in range(steps):
        logits = model.decode_batch(tokens, [len(prompt) + s] * m, caches)
        tokens = logits.argmax(axis=1).tolist()
        seen.append(tokens)
    return m * steps / (clock() - t0), seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens in each row's cache (default 128)")
    ap.add_argument("--steps", type=int, default=32, help="batched steps per measurement (default 32)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--libraries", nargs=2, metavar=("A", "B"), help="two builds of the native library to compare")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="what a row's time is measured in")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for threads in args.threads:
        engine = Engine.load(args.model, progress=False, threads=threads)
        model = engine.session.model
        if not hasattr(model, "decode_batch"):
            raise SystemExit(f"{args.model}: no native batched step here ({engine.decode_path})")
        ids = engine.tokenizer.encode(PROMPT_TEXT * 8)[: args.context]
        window = args.context + args.steps + 1
        caches = {m: [model.new_cache(window) for _ in range(m)] for m in args.rows}
        for row_caches in caches.values():
            for c in row_caches:
                model.run(ids, 0, c)
        sides = ("A", "B") if args.libraries else ("",)
        decoders = {side: NativeDecoder(abi.declare(ctypes.CDLL(path)), model.description.struct, model.description,
                                        native.pool(threads), max_batch=max(args.rows))
                    for side, path in zip(sides, args.libraries or [])}
        speeds: dict[tuple[str, int], list[float]] = {(side, m): [] for side in sides for m in args.rows}
        tokens: dict[tuple[str, int], list] = {}
        for r in range(args.rounds):
            order = args.rows[r % len(args.rows):] + args.rows[: r % len(args.rows)]
            for m in order:
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    if side:
                        model.native = decoders[side]
                    tps, seen = rows_per_s(model, caches[m], ids, args.steps, clock)
                    speeds[(side, m)].append(tps)
                    tokens.setdefault((side, m), seen)
        unit = "tok/CPU-s" if args.clock == "cpu" else "tok/s"
        print(f"{args.model}, {engine.decode_path}, context {args.context}:")
        for side in sides:
            base = statistics.median(speeds[(side, args.rows[0])])
            for m in args.rows:
                tps = statistics.median(speeds[(side, m)])
                print(f"  {side + ' ' if side else ''}M={m}: {tps:.0f} {unit}, {tps / base:.2f}x M={args.rows[0]} "
                      f"(rounds {', '.join(f'{s:.0f}' for s in speeds[(side, m)])})")
        if args.libraries:
            for m in args.rows:
                ratios = [b / a for a, b in zip(speeds[("A", m)], speeds[("B", m)], strict=True)]
                b_a = statistics.median(speeds[("B", m)]) / statistics.median(speeds[("A", m)])
                print(f"  M={m}: B/A {b_a:.3f} (rounds {', '.join(f'{x:.2f}' for x in ratios)}), "
                      f"same tokens: {tokens[('A', m)] == tokens[('B', m)]}")
        engine.close()


if __name__ == "__main__":
    main()
