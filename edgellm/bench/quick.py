"""A quick, honest speed check: fixed prompt/output lengths, warm-up runs dropped, median of the rest."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from edgellm.runtime.engine import Engine
from edgellm.runtime.generation import GenerationParams

_TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines were programmed "
    "by rewiring panels; stored programs replaced the wires, assemblers replaced the numbers, and compilers "
    "replaced the assemblers. Each layer let people think about larger problems while trusting the layer below. "
)


def fixed_prompt(engine: Engine, n_tokens: int) -> list[int]:
    """Exactly n_tokens of real text (repeated as needed), so every run prefills the same work."""
    ids: list[int] = []
    piece = engine.tokenizer.encode(_TEXT)
    while len(ids) < n_tokens:
        ids.extend(piece)
    return ids[:n_tokens]


@dataclass
class QuickBenchReport:
    model: str
    quantization: str
    threads: int
    prompt_tokens: int
    gen_tokens: int
    prefill_tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    torch_version: str = torch.__version__

    def as_dict(self) -> dict[str, object]:
        return {**self.__dict__, "median_prefill_tok_s": statistics.median(self.prefill_tok_s),
                "median_decode_tok_s": statistics.median(self.decode_tok_s),
                "median_ttft_s": statistics.median(self.ttft_s)}

    def format_row(self) -> str:
        d = self.as_dict()
        return (f"{self.model:<28} {self.quantization:<10} threads={self.threads}  "
                f"prefill {d['median_prefill_tok_s']:7.1f} tok/s  decode {d['median_decode_tok_s']:6.1f} tok/s  "
                f"TTFT {d['median_ttft_s'] * 1000:6.0f} ms  (pp{self.prompt_tokens}/tg{self.gen_tokens}, "
                f"median of {len(self.decode_tok_s)} runs, min-max decode "
                f"{min(self.decode_tok_s):.1f}-{max(self.decode_tok_s):.1f})")


def run_quick_bench(model: str, *, quantization: str | None = None, threads: int = 2, prompt_tokens: int = 128,
                    gen_tokens: int = 64, runs: int = 5, warmup: int = 1, progress: bool = True) -> QuickBenchReport:
    engine = Engine.load(model, quantization=quantization, threads=threads, progress=progress,
                         context_window=None)
    if prompt_tokens + gen_tokens > engine.context_window:
        from edgellm.errors import EdgeLLMError

        raise EdgeLLMError(f"prompt + output ({prompt_tokens + gen_tokens}) exceed the context window")
    ids = fixed_prompt(engine, prompt_tokens)
    params = GenerationParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    report = QuickBenchReport(engine.name, engine.config.quantization.scheme, threads, prompt_tokens, gen_tokens)
    for i in range(warmup + runs):
        engine.reset()  # no prefix reuse: every run prefills the whole prompt
        stats = engine.generate(ids, params).stats
        if i >= warmup:
            report.prefill_tok_s.append(stats.prefill_tokens_per_s)
            report.decode_tok_s.append(stats.decode_tokens_per_s)
            report.ttft_s.append(stats.ttft_s)
    engine.close()
    return report
