"""One row of `python -m edgellm.bench.device memory`, in a fresh process that imports only what the engine
does (so no torch where the model runs on the native library): load, fill the window, report peak RSS."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from edgellm.bench.system import peak_rss_bytes
from edgellm.generation import GenerationParams
from edgellm.runtime.engine import Engine

_TEXTS = ("README.md", "docs/server.md", "docs/structured-output.md", "docs/benchmarks.md", "docs/quality.md")


def long_ids(engine: Engine, n: int) -> list[int]:
    """n token ids of the project's documentation (repeated if it is too short)."""
    root = Path(__file__).resolve().parents[2]
    text = "\n\n".join((root / name).read_text(encoding="utf-8") for name in _TEXTS if (root / name).is_file())
    ids = engine.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]



def measure(model: str, context: int, kv: str) -> dict[str, int | str]:
    """Load, fill the window, and the peak RSS after each, with the estimate and the cache's bytes."""
    engine = Engine.load(model, context_window=context, kv_cache=kv, progress=False)
    after_load = peak_rss_bytes()  # VmHWM: getrusage's maximum would carry the spawning process's over exec
    ids = long_ids(engine, context - 2)
    engine.generate(ids, GenerationParams(max_tokens=1, temperature=0.0))
    peak = peak_rss_bytes()
    return {"context": context, "kv": kv, "estimate_total": engine.memory.total_bytes,
            "estimate_kv": engine.memory.kv_cache_bytes, "cache_bytes": engine.cache.nbytes,
            "rss_after_load": after_load, "rss_peak": peak, "torch_loaded": "torch" in sys.modules}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
