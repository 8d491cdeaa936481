"""Tokens/s of the batched native decode step (NativeModel.decode_batch) at M rows per step, each row its own
sequence and KV cache with `--context` prompt tokens already in it, as ratios to M = 1 measured in the same run:
every round times each M once, in a rotated order, and each M's figure is its median over the rounds. One
engine per thread count, loaded up front.

    python scripts/batch_decode_bench.py smollm2-135m --rows 1 2 4 8 --threads 1 2 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from edgellm.bench.backends import PROMPT_TEXT
from edgellm.runtime.engine import Engine


def rows_per_s(model, caches: list, prompt: list[int], steps: int) -> float:
    """Rows decoded per second over `steps` batched steps of len(caches) rows, from position len(prompt) on."""
    m = len(caches)
    tokens = [prompt[i % len(prompt)] for i in range(m)]
    t0 = time.perf_counter()
    for s in range(steps):
        logits = model.decode_batch(tokens, [len(prompt) + s] * m, caches)
        tokens = logits.argmax(axis=1).tolist()
    return m * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens in each row's cache (default 128)")
    ap.add_argument("--steps", type=int, default=32, help="batched steps per measurement (default 32)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
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
        speeds: dict[int, list[float]] = {m: [] for m in args.rows}
        for r in range(args.rounds):
            order = args.rows[r % len(args.rows):] + args.rows[: r % len(args.rows)]
            for m in order:
                speeds[m].append(rows_per_s(model, caches[m], ids, args.steps))
        base = statistics.median(speeds[args.rows[0]])
        print(f"{args.model}, {engine.decode_path}, context {args.context}:")
        for m in args.rows:
            tps = statistics.median(speeds[m])
            print(f"  M={m}: {tps:.0f} tok/s, {tps / base:.2f}x M={args.rows[0]} "
                  f"(rounds {', '.join(f'{s:.0f}' for s in speeds[m])})")
        engine.close()


if __name__ == "__main__":
    main()
