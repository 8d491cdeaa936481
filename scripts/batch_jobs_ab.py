"""Throughput of `run --batch` (runtime/batch_jobs.py) decoding its prompts together, against the prompts run one
after another through Engine.generate (what `run --batch` did before the batched step), on one engine: every
round times each way once, in a rotated order; aggregate generated tokens/s per way, each round's and the median.
Every way's greedy texts are checked equal to the one-after-another texts.

    python scripts/batch_jobs_ab.py smollm2-135m --prompts 16 --max-tokens 128 --parallel 4 8 --threads 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from edgellm.generation import GenerationParams
from edgellm.runtime.batch_jobs import BatchItem, run_batch
from edgellm.runtime.engine import Engine

TOPICS = ["the water cycle", "how a bicycle works", "the history of tea", "why the sky is blue", "volcanoes",
          "the moon's phases", "how bread rises", "honey bees", "the printing press", "rainbows", "glaciers",
          "how a compass works", "coral reefs", "the first airplanes", "photosynthesis", "how vaccines work"]


def one_after_another(engine: Engine, items: list[BatchItem], params: GenerationParams) -> tuple[int, list[str]]:
    tokens, texts = 0, []
    for item in items:
        result = engine.chat([{"role": "user", "content": item.prompt or ""}], params)
        tokens += result.stats.completion_tokens
        texts.append(result.text)
    return tokens, texts


def batched(engine: Engine, items: list[BatchItem], params: GenerationParams, parallel: int) -> tuple[int, list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        run_batch(engine, items, out, params, progress=False, parallel=parallel)
        lines = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    rows = [lines[item.id] for item in items]
    return sum(r["usage"]["completion_tokens"] for r in rows), [r["text"] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--parallel", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = Engine.load(args.model, progress=False, threads=args.threads, sequences=max(args.parallel))
    items = [BatchItem(str(i), f"Write a long, detailed explanation of {TOPICS[i % len(TOPICS)]}.", None, {})
             for i in range(args.prompts)]
    params = GenerationParams(temperature=0.0, max_tokens=args.max_tokens)
    ways = ["one after another", *(f"parallel {p}" for p in args.parallel)]
    speeds: dict[str, list[float]] = {way: [] for way in ways}
    reference: list[str] | None = None
    for r in range(args.rounds):
        for way in ways[r % len(ways):] + ways[: r % len(ways)]:
            t0 = time.perf_counter()
            if way == ways[0]:
                tokens, texts = one_after_another(engine, items, params)
            else:
                tokens, texts = batched(engine, items, params, int(way.split()[1]))
            speeds[way].append(tokens / (time.perf_counter() - t0))
            reference = reference or (texts if way == ways[0] else None)
            if reference is not None and texts != reference:
                raise SystemExit(f"{way}: the texts differ from one after another")
        print(f"round {r + 1}: " + ", ".join(f"{w} {speeds[w][-1]:.1f}" for w in ways), flush=True)
    base = statistics.median(speeds[ways[0]])
    for way in ways:
        med = statistics.median(speeds[way])
        print(f"{way}: median {med:.1f} tok/s ({med / base:.2f}x)")


if __name__ == "__main__":
    main()
