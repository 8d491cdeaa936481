"""Hugging Face path: tiny random Llama / Qwen2 made by transformers, converted, compared logit for logit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.errors import UnsupportedModelError
from edgellm.runtime.engine import Engine
from tests.tiny import VOCAB, make_tiny

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", False), ("qwen2", True)])
def test_f32_logits_match_transformers(tmp_path: Path, arch: str, tied: bool) -> None:
    ref = make_tiny(tmp_path / "hf", arch, tied=tied)
    art = convert(tmp_path / "hf", tmp_path / "art", quantization="q0f32", progress=False, prefill_chunk_size=7)
    engine = Engine(open_artifact(art), threads=1)
    ids = torch.randint(0, VOCAB - 2, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    got = engine.logits(ids[0].tolist())  # prefilled in chunks of 7 through the KV cache
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4

    # the same logits one token at a time through the KV cache, and all at once
    engine.reset()
    cache = engine.model.new_cache(64)
    steps = torch.cat([engine.model(ids[:, i : i + 1], i, cache)[0] for i in range(ids.shape[1])])
    assert (steps - expected).abs().max().item() <= 1e-4
    whole = engine.model(ids, 0, engine.model.new_cache(64), all_logits=True)[0]
    assert (whole - expected).abs().max().item() <= 1e-4


def test_greedy_generation_matches_transformers(tmp_path: Path) -> None:
    ref = make_tiny(tmp_path / "hf", "qwen2", tied=False)
    art = convert(tmp_path / "hf", tmp_path / "art", quantization="q0f32", progress=False)
    engine = Engine(open_artifact(art), threads=1)
    prompt = [5, 17, 42, 99, 3]
    from edgellm.generation import GenerationParams

    ours = engine.generate(prompt, GenerationParams(max_tokens=20, temperature=0.0, ignore_eos=True)).token_ids
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs


def test_quantized_artifacts_stay_close(tmp_path: Path) -> None:
    make_tiny(tmp_path / "hf", "llama", tied=True)
    f32 = Engine(open_artifact(convert(tmp_path / "hf", tmp_path / "f32", quantization="q0f32", progress=False)))
    ids = list(range(1, 50))
    base = torch.log_softmax(f32.logits(ids), -1)
    for scheme, bound in [("q0f16", 1e-4), ("q8f16_1", 1e-3), ("q4f16_1e8", 5e-2), ("q4f16_1", 5e-2)]:
        art = convert(tmp_path / "hf", tmp_path / scheme, quantization=scheme, progress=False)
        logp = torch.log_softmax(Engine(open_artifact(art)).logits(ids), -1)
        kl = (base.exp() * (base - logp)).sum(-1).mean().item()
        assert kl < bound, (scheme, kl)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, Qwen2ForCausalLM"):
        convert(folder, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_pickled_weights_are_never_loaded(tmp_path: Path) -> None:
    make_tiny(tmp_path / "hf", "llama", tied=True)
    for p in (tmp_path / "hf").glob("*.safetensors"):
        p.rename(p.with_name("pytorch_model.bin"))
    with pytest.raises(UnsupportedModelError, match="pickled weights are never loaded"):
        convert(tmp_path / "hf", tmp_path / "out", progress=False)
