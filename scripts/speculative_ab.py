"""Prompt-lookup speculative decoding on the extraction task items (`edgellm eval task`), A/B alternated per item:
decode tokens/s without and with `speculative="lookup"`, whether the outputs are the same bytes, and the draft
acceptance. `--verify prefill` measures instead what verifying each draft in one native prefill call (all its
positions' logits at once, with the prefill's arithmetic) would give — not what the engine does (docs/server.md).

    python scripts/speculative_ab.py MODEL [--items N] [--max-tokens N] [--verify step|prefill]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Iterator, Sequence

import numpy as np

from edgellm.eval.tasks import load_dataset, messages
from edgellm.generation import GenerationParams
from edgellm.session import generation_session
from edgellm.runtime.engine import Engine


def prefill_rows(model: Any, ids: Sequence[int], start: int, cache: Any) -> Iterator[np.ndarray]:
    """Every position's logits from one native prefill call (the positions after a refused token computed too)."""
    return iter(model.run(list(ids), start, cache, all_logits=True)) if len(ids) > 1 else \
        iter([model.run(list(ids), start, cache)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--items", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--verify", choices=("step", "prefill"), default="step")
    args = parser.parse_args()
    if args.verify == "prefill":
        generation_session.step_rows = prefill_rows  # type: ignore[assignment]
    engine = Engine.load(args.model, progress=False)
    plain_tps, spec_tps, same, drafted, accepted, tokens = [], [], 0, 0, 0, 0
    for item in load_dataset()[: args.items]:
        prompt = engine.render(messages(item))
        results = {}
        for spec in (None, "lookup"):
            engine.reset()
            results[spec] = engine.generate(prompt, GenerationParams(temperature=0.0, max_tokens=args.max_tokens,
                                                                     speculative=spec))
        plain, spec = results[None], results["lookup"]
        plain_tps.append(plain.stats.decode_tokens_per_s)
        spec_tps.append(spec.stats.decode_tokens_per_s)
        same += spec.text == plain.text
        drafted += spec.stats.draft_tokens
        accepted += spec.stats.accepted_tokens
        tokens += spec.stats.completion_tokens
        print(f"{item['id']}: {plain.stats.decode_tokens_per_s:.0f} -> {spec.stats.decode_tokens_per_s:.0f} tok/s, "
              f"{spec.stats.accepted_tokens}/{spec.stats.draft_tokens} drafts kept, "
              f"{'same' if spec.text == plain.text else 'DIFFERENT'} output")
    ratios = [s / p for s, p in zip(spec_tps, plain_tps) if p > 0]
    print(f"{args.model} verify={args.verify}: median decode ratio {statistics.median(ratios):.2f}x "
          f"(plain {statistics.median(plain_tps):.0f}, lookup {statistics.median(spec_tps):.0f} tok/s); "
          f"{same}/{len(ratios)} outputs identical; drafts kept {accepted}/{drafted} "
          f"({accepted / max(drafted, 1):.0%}); {accepted / max(tokens, 1):.0%} of output tokens were drafted")


if __name__ == "__main__":
    main()
