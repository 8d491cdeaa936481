"""Speculative decoding on the extraction task items (`edgellm eval task`), alternated per item (the order rotated
from item to item): decode tokens/s without and with `speculative="lookup"` and, with `--draft DRAFT`, with
`speculative="draft:DRAFT"` and the draft model alone (its own plain decoding: the cost of one draft step against the
target's); prompt lookup also as "lookup/prompt", with an empty reply memory (the request's own tokens alone:
session/speculative.py's ReplyMemory holds the earlier items' lookup replies); whether the outputs are the same bytes, and the draft acceptance. `--verify prefill` measures instead what
verifying each draft in one native prefill call (all its positions' logits at once, with the prefill's arithmetic)
would give — not what the engine does (docs/server.md). `--mode constrained` asks for each item's JSON schema, as
`edgellm eval task`'s constrained mode does (prompt lookup then also drafts the tokens the grammar forces);
`--every K` takes every K-th item (K = 10: one per scenario and language) instead of the first N.

    python scripts/speculative_ab.py MODEL [--items N] [--every K] [--mode unconstrained|constrained]
        [--max-tokens N] [--verify step|prefill] [--draft DRAFT]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from typing import Any, Iterator, Sequence

import numpy as np

from edgellm.eval.tasks import MODES, item_request, load_dataset
from edgellm.session import generation_session
from edgellm.runtime.engine import Engine
from edgellm.session.speculative import ReplyMemory


def prefill_rows(model: Any, ids: Sequence[int], start: int, cache: Any) -> Iterator[np.ndarray]:
    """Every position's logits from one native prefill call (the positions after a refused token computed too)."""
    return iter(model.run(list(ids), start, cache, all_logits=True)) if len(ids) > 1 else \
        iter([model.run(list(ids), start, cache)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--items", type=int, default=12)
    parser.add_argument("--every", type=int, default=1, help="every K-th item of the dataset (default: each)")
    parser.add_argument("--mode", choices=MODES, default="unconstrained")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--verify", choices=("step", "prefill"), default="step")
    parser.add_argument("--draft", default=None, help="also speculative='draft:DRAFT' (and DRAFT alone)")
    args = parser.parse_args()
    if args.verify == "prefill":
        generation_session.step_rows = prefill_rows  # type: ignore[assignment]
    draft = f"draft:{args.draft}" if args.draft else None
    engine = Engine.load(args.model, progress=False, speculative=draft)
    engine.speculative = None  # each request names its method
    alone = Engine.load(args.draft, progress=False) if args.draft else None
    methods: list[str | None] = [None, "lookup", "lookup/prompt"] + ([draft, "alone"] if draft else [])
    tps: dict[str | None, list[float]] = {m: [] for m in methods}
    same = dict.fromkeys(methods, 0)
    drafted, accepted, tokens = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0), dict.fromkeys(methods, 0)
    forced = dict.fromkeys(methods, 0)
    for n, item in enumerate(load_dataset()[:: args.every][: args.items]):
        request = item_request(engine, item, args.mode, args.max_tokens)  # greedy, as `eval task` asks
        results = {}
        for method in methods[n % len(methods):] + methods[: n % len(methods)]:
            runner = alone if method == "alone" else engine
            assert runner is not None
            runner.reset()
            memory = runner.session.reply_memory
            if method == "lookup/prompt":
                runner.session.reply_memory = ReplyMemory()
            results[method] = runner.generate(request.prompt, replace(
                request.params, speculative={"alone": None, "lookup/prompt": "lookup"}.get(method or "", method)))
            runner.session.reply_memory = memory
        plain = results[None]
        line = [f"{item['id']}: plain {plain.stats.decode_tokens_per_s:.0f} tok/s"]
        for method in methods:
            r = results[method]
            tps[method].append(r.stats.decode_tokens_per_s)
            if method is None:
                continue
            same[method] += r.text == plain.text
            drafted[method] += r.stats.draft_tokens
            accepted[method] += r.stats.accepted_tokens
            forced[method] += r.stats.forced_draft_tokens
            tokens[method] += r.stats.completion_tokens
            line.append(f"{method} {r.stats.decode_tokens_per_s:.0f}"
                        + (f" ({r.stats.accepted_tokens}/{r.stats.draft_tokens} kept, "
                           f"{'same' if r.text == plain.text else 'DIFFERENT'})" if method != "alone" else ""))
        print("; ".join(line), flush=True)
    print(f"{args.model} {args.mode} verify={args.verify}: plain median {statistics.median(tps[None]):.0f} tok/s")
    for method in methods[1:]:
        ratios = [s / p for s, p in zip(tps[method], tps[None]) if p > 0]
        if method == "alone":
            print(f"  {args.draft} alone: median {statistics.median(tps[method]):.0f} tok/s, one draft step costs "
                  f"{statistics.median([1 / r for r in ratios]):.2f}x the target's")
            continue
        print(f"  {method}: median decode ratio {statistics.median(ratios):.2f}x "
              f"({statistics.median(tps[method]):.0f} tok/s); {same[method]}/{len(ratios)} outputs identical; "
              f"drafts kept {accepted[method]}/{drafted[method]} ({accepted[method] / max(drafted[method], 1):.0%}; "
              f"{forced[method]} drafted tokens forced by the grammar); "
              f"{accepted[method] / max(tokens[method], 1):.0%} of output tokens were drafted")


if __name__ == "__main__":
    main()
