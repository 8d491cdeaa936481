"""Quality gap of candidates vs a reference over the same token windows (llama.cpp's method).

Each text is tokenized with the reference's tokenizer and cut into non-overlapping windows of
`ctx` tokens (a shorter tail window is kept if it has at least 64 tokens). The first token of a
window is BOS when the model adds one. Like llama.cpp's `perplexity`, only the second half of each
window is scored, so every scored token has at least ctx/2 tokens of context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from edgellm.errors import EdgeLLMError
from edgellm.eval.metrics import GapMetrics, position_stats, summarize

if TYPE_CHECKING:
    from edgellm.runtime.engine import Engine

DATA = Path(__file__).parent / "data"
DEFAULT_CORPUS = sorted((DATA / "corpus").glob("*.txt"))
MIN_WINDOW = 64


@dataclass
class Scorer:
    """Something that turns token ids into next-token logits (T, V): an artifact or a GGUF in llama.cpp.

    `logits(ids, step_from=k)` computes positions from k on as generation does, one token at a time.
    """

    name: str
    scheme: str
    size_bytes: int
    logits: Callable[..., torch.Tensor]
    vocab_size: int
    close: Callable[[], None] = lambda: None
    engine: Engine | None = None  # None for a .gguf scored by llama.cpp


def open_scorer(spec: str | Path, *, threads: int | None = None, ctx: int = 512, kv_cache: str | None = None,
                runtime: str | None = None) -> Scorer:
    """An artifact folder / catalog name (edgellm engine, over `kv_cache` or the artifact's default KV cache
    kind; `runtime` as Engine takes it), or a `.gguf` file scored by llama.cpp."""
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _llama_cpp_scorer(path, threads=threads, ctx=ctx)
    from edgellm.runtime.engine import Engine

    engine = Engine.load(spec, threads=threads, progress=False, kv_cache=kv_cache, runtime=runtime)
    return Scorer(engine.name, engine.config.quantization.scheme, engine.artifact.manifest.total_bytes,
                  engine.logits, engine.config.model.vocab_size, engine.close, engine)


def _llama_cpp_scorer(path: Path, *, threads: int | None, ctx: int) -> Scorer:
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise EdgeLLMError(f"scoring a .gguf needs llama-cpp-python (pip install -e '.[compare]'): {exc}") from None
    llm = Llama(model_path=str(path), n_ctx=ctx, n_batch=ctx, logits_all=True, verbose=False,
                n_threads=threads or torch.get_num_threads())

    def logits(ids: list[int], step_from: int | None = None) -> torch.Tensor:
        del step_from  # llama.cpp quantizes activations in every path: its batch logits are its decode's
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(llm.scores[: len(ids)].copy())

    return Scorer(f"{path.name} (llama.cpp)", "gguf", path.stat().st_size, logits, llm.n_vocab(),
                  lambda: llm.close() if hasattr(llm, "close") else None)


def windows(ids: Sequence[int], ctx: int, bos: int | None) -> list[list[int]]:
    """Non-overlapping windows of `ctx` tokens (tail kept if ≥ 64); first token replaced by BOS if given."""
    if ctx < 16:
        raise EdgeLLMError(f"window length {ctx} is too short (at least 16 tokens)")
    out = []
    for start in range(0, len(ids), ctx):
        w = list(ids[start : start + ctx])
        if len(w) < min(ctx, MIN_WINDOW):
            break
        if bos is not None:
            w[0] = bos
        out.append(w)
    return out


def scored_slice(n: int) -> tuple[int, int]:
    """Logit rows [first, n-1) are scored; row j predicts token j+1."""
    return n // 2, n - 1


@dataclass
class QualityResult:
    """Per candidate: the gap over all texts, and per text."""

    reference: dict[str, Any]
    candidates: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        rates = {f"{c['name']}.top1_agreement": round(100 * c["metrics"]["top1_agreement"], 2)
                 for c in self.candidates}
        return {"kind": "quality", "reference": self.reference, "candidates": self.candidates,
                "settings": self.settings, "rates": rates}


PATHS = ("prefill", "decode")


def evaluate_quality(reference: Scorer, candidates: list[Scorer], texts: Sequence[Path], *, ctx: int = 512,
                     max_windows: int | None = None, progress: Callable[[str], None] | None = None,
                     path: str = "prefill") -> QualityResult:
    """Score every candidate against the reference on the same windows (at most `max_windows` per text).

    `path` is how an edgellm candidate computes the scored positions: "prefill" (its prefill chunks) or
    "decode" (one token at a time, as generation does). The reference always uses its prefill.
    """
    if path not in PATHS:
        raise EdgeLLMError(f"path must be one of {', '.join(PATHS)}, not {path!r}")
    if reference.engine is None:
        raise EdgeLLMError("the reference must be an edgellm artifact (its tokenizer cuts the windows)")
    for c in candidates:
        if c.vocab_size != reference.vocab_size:
            raise EdgeLLMError(f"{c.name} has a vocabulary of {c.vocab_size}, the reference {reference.vocab_size}")
    tok = reference.engine.tokenizer
    bos = tok.bos_token_id if reference.engine.config.tokenizer.add_bos_token else None
    per_text: dict[str, list[list[dict[str, torch.Tensor]]]] = {}
    seconds = [0.0] * len(candidates)
    n_windows = 0
    for text in texts:
        ids = tok.encode(Path(text).read_text(encoding="utf-8"), add_bos=False)
        stats: list[list[dict[str, torch.Tensor]]] = [[] for _ in candidates]
        for w in windows(ids, ctx, bos)[:max_windows]:
            n_windows += 1
            lo, hi = scored_slice(len(w))
            targets = torch.tensor(w[lo + 1 : hi + 1])
            ref = reference.logits(w)[lo:hi].float()
            for i, cand in enumerate(candidates):
                t0 = time.perf_counter()
                logits = (cand.logits(w, step_from=lo) if path == "decode" else cand.logits(w))[lo:hi].float()
                seconds[i] += time.perf_counter() - t0
                stats[i].append(position_stats(ref, logits, targets))
            if progress:
                progress(f"{Path(text).name}: window {len(stats[0]) if stats else 0} ({len(w)} tokens)")
        if stats and stats[0]:
            per_text[Path(text).name] = stats
    if not per_text:
        raise EdgeLLMError(f"no window of at least {min(ctx, MIN_WINDOW)} tokens in the texts given")
    result = QualityResult(
        reference={"name": reference.name, "scheme": reference.scheme, "size_bytes": reference.size_bytes},
        settings={"ctx": ctx, "scored_per_window": "second half", "windows": n_windows, "path": path,
                  "texts": list(per_text)},
    )
    for i, cand in enumerate(candidates):
        everything = [s for stats in per_text.values() for s in stats[i]]
        overall: GapMetrics = summarize(everything)
        result.candidates.append({
            "name": cand.name, "scheme": cand.scheme, "size_bytes": cand.size_bytes,
            "metrics": overall.as_dict(), "seconds": round(seconds[i], 2),
            "per_text": {name: summarize(stats[i]).as_dict() for name, stats in per_text.items()},
        })
    return result
