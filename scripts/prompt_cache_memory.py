"""The prompt cache's memory: what the engine states (its budget in the memory estimate, the bytes per cached token)
against what it holds and the process's resident memory after prompts of ~1,000 distinct tokens each.

    python scripts/prompt_cache_memory.py MODEL [--budget-mb MIB] [--prompts N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgellm.generation import GenerationParams
from edgellm.models.kv_space import bytes_per_token
from edgellm.runtime.engine import Engine
from edgellm.bench.memory_probe import long_ids

MIB = 2**20


def rss_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--budget-mb", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    engine = Engine.load(args.model, progress=False, prompt_cache=args.budget_mb * MIB)
    m = engine.config.model
    per_token = bytes_per_token(m.num_hidden_layers, m.num_key_value_heads, m.head_dim, engine.kv_cache)
    print(f"stated: {engine.memory.describe()}; {per_token} B per cached token ({engine.kv_cache})")
    params = GenerationParams(max_tokens=1, temperature=0.0)
    ids = long_ids(engine, 1000 * (args.prompts + 1))
    engine.generate(ids[-1000:], params)  # warm: the live cache and a first prefill's buffers
    base = rss_bytes()
    for k in range(args.prompts):
        engine.generate(ids[k * 1000 : (k + 1) * 1000], params)
        cache = engine.session.prompt_cache
        print(f"after prompt {k + 1} (1000 tokens): {len(cache.entries)} entries, {cache.nbytes / MIB:.1f} MiB held "
              f"(budget {args.budget_mb}), RSS +{(rss_bytes() - base) / MIB:.1f} MiB")

if __name__ == "__main__":
    main()
