"""TTFT of a request sharing a ~1,000-token system prompt with an earlier one, another request in between (so the
shared prefix comes from the prompt cache, not the live KV cache), against the first request's cold TTFT; then the
same after a restart with the cache persisted in a folder. Greedy requests (exact prefix reuse).

    python scripts/prompt_cache_ttft.py MODEL [--rounds N] [--budget-mb MIB]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from edgellm.eval.tasks import load_dataset
from edgellm.generation import GenerationParams
from edgellm.runtime.engine import Engine

PARAMS = GenerationParams(max_tokens=8, temperature=0.0)


def system_prompt(engine: Engine, tokens: int = 1000) -> str:
    """Clinic rules made of the extraction items' inputs, cut to about `tokens` tokens."""
    text = "You are a careful assistant for a clinic. Follow these rules.\n" + "\n".join(
        f"Rule {i}: {item['input']}" for i, item in enumerate(load_dataset()[:60]))
    while len(engine.encode(text)) > tokens:
        text = text[: int(len(text) * 0.98)]
    return text


def ask(engine: Engine, system: str, question: str) -> tuple[float, int]:
    prompt = engine.render([{"role": "system", "content": system}, {"role": "user", "content": question}])
    stats = engine.generate(prompt, PARAMS).stats
    return stats.ttft_s, stats.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-mb", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        engine = Engine.load(args.model, progress=False, prompt_cache=args.budget_mb * 2**20, prompt_cache_dir=folder)
        system = system_prompt(engine)
        other = "You translate short notes into French. Keep names as they are."
        cold, warm = [], []
        for r in range(args.rounds):
            engine.reset()
            engine.session.prompt_cache.entries.clear()
            first, cached0 = ask(engine, system, f"Round {r}: which rule mentions an allergy?")
            ask(engine, other, "The meeting moved to Friday.")  # the live cache now holds another prompt
            second, cached1 = ask(engine, system, f"Round {r}: which rule mentions a child?")
            cold.append(first)
            warm.append(second)
            print(f"round {r}: first {first * 1000:.0f} ms ({cached0} cached), second {second * 1000:.0f} ms "
                  f"({cached1} cached): {second / first:.3f}")
        engine.close()  # the live prefix is persisted too
        restarted = Engine.load(args.model, progress=False, prompt_cache=args.budget_mb * 2**20,
                                prompt_cache_dir=folder)
        after, cached = ask(restarted, system, "After a restart: which rule mentions a fever?")
        print(f"system prompt {len(engine.encode(system))} tokens; median second/first "
              f"{statistics.median(w / c for w, c in zip(warm, cold)):.3f}; after a restart {after * 1000:.0f} ms "
              f"({cached} cached): {after / statistics.median(cold):.3f} of the median cold TTFT")


if __name__ == "__main__":
    main()
