"""Correctness against an independent reference: q0f32 artifacts vs transformers loading the same GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgellm.artifact.reader import open_artifact
from edgellm.resolve import resolve_model
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TEXT = (Path(__file__).parent / "data" / "reference_en.txt").read_text(encoding="utf-8")


def _distribution_gap(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """Mean KL(theirs || ours) of next-token distributions, and top-1 agreement."""
    p = torch.log_softmax(theirs.double(), -1)
    q = torch.log_softmax(ours.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    top1 = (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item()
    return kl, top1


def _compare_with_transformers(gguf: Path, name: str, n_tokens: int) -> None:
    engine = Engine(open_artifact(resolve_model(f"{name}:q0f32", progress=False)))
    ids = engine.tokenizer.encode(TEXT)[:n_tokens]
    assert len(ids) >= 256
    ours = engine.logits(ids)
    engine.close()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    kl, top1 = _distribution_gap(ours, theirs)
    print(f"\n{name} q0f32 vs transformers over {len(ids)} tokens: mean KL {kl:.2e}, top-1 agreement {top1:.2%}")
    assert kl < 1e-4
    assert top1 >= 0.995


def test_smollm2_q0f32_matches_transformers(smollm2_gguf: Path) -> None:
    _compare_with_transformers(smollm2_gguf, "smollm2-135m", 400)


@pytest.mark.slow
def test_qwen_q0f32_matches_transformers(qwen_gguf: Path) -> None:
    _compare_with_transformers(qwen_gguf, "qwen2.5-coder-0.5b", 300)


# The README's table (smollm2-135m, 400 tokens of tests/data/reference_en.txt): mean KL vs q0f32 and top-1
# agreement. Quantized matmuls run with bf16 activations, whose rounding differs between CPUs, so each figure is
# asserted with a margin: KL at most 1.5x the README's, top-1 at most 4 points below. A change that makes a
# scheme better passes; one that makes it worse than the README claims fails.
README_FIGURES = {"q8f16_1": (0.0044, 0.940), "q4f16_1": (0.060, 0.815), "q4f16_1e8": (0.0022, 0.963)}
KL_MARGIN, TOP1_MARGIN = 1.5, 0.04
README_TOKENS = 400


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf: Path) -> tuple[list[int], torch.Tensor]:
    ref = Engine.load("smollm2-135m:q0f32", progress=False)
    ids = ref.tokenizer.encode(TEXT)[:README_TOKENS]
    assert len(ids) == README_TOKENS
    logits = ref.logits(ids)
    ref.close()
    return ids, logits


@pytest.mark.parametrize("scheme", list(README_FIGURES))
def test_quantized_smollm2_answers_and_keeps_the_readme_figures(
        scheme: str, smollm2_reference: tuple[list[int], torch.Tensor]) -> None:
    engine = Engine.load(f"smollm2-135m:{scheme}", progress=False)
    reply = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                        GenerationParams(max_tokens=24, temperature=0.0))
    assert "Paris" in reply.text, reply.text
    ids, reference = smollm2_reference
    ours = engine.logits(ids)
    engine.close()
    kl, top1 = _distribution_gap(ours, reference)
    readme_kl, readme_top1 = README_FIGURES[scheme]
    print(f"\nsmollm2-135m {scheme} vs q0f32 over {len(ids)} tokens: mean KL {kl:.4f}, top-1 agreement {top1:.2%}"
          f" (README: {readme_kl}, {readme_top1:.1%})")
    assert kl <= KL_MARGIN * readme_kl, (scheme, kl)
    assert top1 >= readme_top1 - TOP1_MARGIN, (scheme, top1)
