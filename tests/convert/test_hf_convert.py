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
from tests.support.tiny import VOCAB, make_tiny

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


def test_every_decode_step_matches_transformers(tmp_path: Path) -> None:
    """Sampled (so the tokens vary, unlike this random model's greedy output), the logits of each decode step must
    equal transformers' logits for the whole sequence at that position: KV slots and RoPE positions line up."""
    ref = make_tiny(tmp_path / "hf", "qwen2", tied=False)
    art = convert(tmp_path / "hf", tmp_path / "art", quantization="q0f32", progress=False)
    engine = Engine(open_artifact(art), threads=1)
    prompt = [5, 17, 42, 99, 3]
    from edgellm.generation import GenerationParams

    seen: list[torch.Tensor] = []

    def record(generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits.clone())
        return logits

    out = engine.generate(prompt, GenerationParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True,
                                                   logits_processors=[record])).token_ids
    assert len(set(out)) > 5  # varied tokens
    with torch.no_grad():
        theirs = ref(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    assert len(seen) == len(out) == len(theirs)
    assert (torch.stack(seen) - theirs).abs().max().item() <= 1e-4


# Upper bounds on the mean KL(f32 || quantized) over 49 positions of the peaked tiny model; measured values are
# about 30x lower (q0f16 2.5e-8, q8f16_1 3.5e-5, q4f16_1e8 1.5e-3, q4f16_1 2.8e-3), and a q4 quantizer whose
# min is off by half a step scores 0.66, so the bounds sit between working and broken with room on both sides.
KL_BOUNDS = {"q0f16": 1e-6, "q8f16_1": 1e-3, "q4f16_1e8": 2e-2, "q4f16_1": 3e-2}
PEAKED_IDS = list(range(1, 50))


@pytest.fixture(scope="module")
def peaked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A tiny Llama whose final norm is scaled 8x, so its next-token distributions are peaked (mean top
    probability ~0.8 instead of ~0.01 for the random model): a quantizer that flattens or shifts the logits
    then moves KL by orders of magnitude. Returns its folder and the f32 artifact's log-probabilities."""
    root = tmp_path_factory.mktemp("peaked")
    model = make_tiny(root / "hf", "llama", tied=True)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(root / "hf", safe_serialization=True)
    f32 = Engine(open_artifact(convert(root / "hf", root / "f32", quantization="q0f32", progress=False)))
    base = torch.log_softmax(f32.logits(PEAKED_IDS), -1)
    assert base.exp().amax(-1).mean().item() > 0.5  # peaked: constant logits would score KL ~4.4
    return root / "hf", base


def _kl_and_top1(folder: Path, out: Path, scheme: str, base: torch.Tensor) -> tuple[float, float]:
    logp = torch.log_softmax(Engine(open_artifact(convert(folder, out, quantization=scheme,
                                                          progress=False))).logits(PEAKED_IDS), -1)
    kl = (base.exp() * (base - logp)).sum(-1).mean().item()
    return kl, (base.argmax(-1) == logp.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("scheme", list(KL_BOUNDS))
def test_quantized_artifacts_stay_close(tmp_path: Path, peaked: tuple[Path, torch.Tensor], scheme: str) -> None:
    folder, base = peaked
    kl, top1 = _kl_and_top1(folder, tmp_path / scheme, scheme, base)
    print(f"\n{scheme}: KL {kl:.3g}, top-1 {top1:.3f}")
    assert kl < KL_BOUNDS[scheme] and top1 >= 0.95, (scheme, kl, top1)


def test_a_broken_quantizer_fails_the_closeness_check(tmp_path: Path, peaked: tuple[Path, torch.Tensor],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is not vacuous: q4 with every min off by half a step (round vs floor) fails it."""
    from edgellm.quant import formats

    right = formats._quantize_q4

    def off_by_half_a_step(w: torch.Tensor) -> dict[str, torch.Tensor]:
        # row blocks el_block_q4: f16 d, f16 m, 16 nibble bytes (stored interleaved, 8 rows at a time)
        blocks = formats.row_blocks(right(w)["qweight"], "q4").view(w.shape[0], -1, 20)
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        blocks[..., 2:4] = (m - 0.5 * d).half().view(torch.uint8)
        return {"qweight": formats.interleave(blocks.view(w.shape[0], -1), "q4")}

    monkeypatch.setattr(formats, "_quantize_q4", off_by_half_a_step)
    folder, base = peaked
    kl, _ = _kl_and_top1(folder, tmp_path / "broken", "q4f16_1", base)
    assert kl > 10 * KL_BOUNDS["q4f16_1"], kl


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
