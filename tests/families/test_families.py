"""Every model family against transformers: tiny random models, converted at q0f32, compared logit for logit
through whole-prompt, chunked-prefill and token-by-token paths, and greedy generation token for token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.errors import UnsupportedModelError
from edgellm.families.registry import FAMILIES
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams
from tests.support.tiny import VOCAB, _save_tokenizer

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=VOCAB - 2,
              eos_token_id=VOCAB - 1, pad_token_id=0)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.0 + 0.7 * i for i in range(8)], "original_max_position_embeddings": 32}


def _qwen3() -> Any:
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=2, rope_theta=1e6,
                                                                   tie_word_embeddings=False, **COMMON))


def _gemma2() -> Any:
    cfg = transformers.Gemma2Config(num_hidden_layers=4, query_pre_attn_scalar=24, sliding_window=8,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0, **COMMON)
    return transformers.Gemma2ForCausalLM(cfg)


def _gemma3() -> Any:
    cfg = transformers.Gemma3TextConfig(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_scaling={"rope_type": "linear", "factor": 2.0}, **COMMON)
    return transformers.Gemma3ForCausalLM(cfg)


def _gemma3_capped() -> Any:
    cfg = transformers.Gemma3TextConfig(num_hidden_layers=2, sliding_window=6, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=3.0, tie_word_embeddings=False, **COMMON)
    return transformers.Gemma3ForCausalLM(cfg)


def _phi3() -> Any:
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(num_hidden_layers=2, sliding_window=12, **COMMON))


def _phi3_longrope() -> Any:
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(num_hidden_layers=2, rope_scaling=dict(LONGROPE),
                                                                original_max_position_embeddings=32, **COMMON))


def _llama3_rope() -> Any:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, rope_scaling=scaling, **COMMON))


MODELS: dict[str, Callable[[], Any]] = {
    "qwen3": _qwen3, "gemma2": _gemma2, "gemma3": _gemma3, "gemma3-capped": _gemma3_capped, "phi3": _phi3,
    "phi3-longrope": _phi3_longrope, "llama3-rope": _llama3_rope,
}


def _make(folder: Path, build: Callable[[], Any]) -> Any:
    """A random model with random norm weights (their default ones/zeros would hide a wrong norm)."""
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.config._attn_implementation = "eager"  # soft-capping needs it; the same numerics for the others
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder)
    return model


def _hf_logits(model: Any, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """transformers' logits for `ids`, fed `chunk` tokens at a time through its own KV cache."""
    cache, out = transformers.DynamicCache(config=model.config), []
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            out.append(model(ids[:, s : s + chunk], past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(out)


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Engine]:
    root = tmp_path_factory.mktemp(request.param)
    ref = _make(root / "hf", MODELS[request.param])
    art = convert(root / "hf", root / "art", quantization="q0f32", progress=False, prefill_chunk_size=7)
    return ref, Engine(open_artifact(art), threads=1)


IDS = torch.randint(0, VOCAB - 2, (1, 40), generator=torch.Generator().manual_seed(1))


def test_whole_prompt_matches(pair: tuple[Any, Engine]) -> None:
    ref, engine = pair
    got = engine.model(IDS, 0, engine.model.new_cache(64), all_logits=True)[0]
    assert (got - _hf_logits(ref, IDS, IDS.shape[1])).abs().max().item() <= 1e-4


def test_chunked_prefill_matches(pair: tuple[Any, Engine]) -> None:
    ref, engine = pair
    got = engine.logits(IDS[0].tolist())  # chunks of 7 through the KV cache
    assert (got - _hf_logits(ref, IDS, 7)).abs().max().item() <= 1e-4


def test_token_by_token_matches(pair: tuple[Any, Engine]) -> None:
    ref, engine = pair
    cache = engine.model.new_cache(64)
    got = torch.cat([engine.model(IDS[:, i : i + 1], i, cache)[0] for i in range(IDS.shape[1])])
    assert (got - _hf_logits(ref, IDS, 1)).abs().max().item() <= 1e-4


def test_greedy_generation_matches(pair: tuple[Any, Engine]) -> None:
    ref, engine = pair
    prompt = IDS[0, :12].tolist()
    ours = engine.generate(prompt, GenerationParams(max_tokens=24, temperature=0.0, ignore_eos=True)).token_ids
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs


def test_every_family_is_exercised() -> None:
    built = {type(build()).__name__ for build in MODELS.values()}
    covered_elsewhere = {"LlamaForCausalLM", "Qwen2ForCausalLM"}  # tests/test_hf_convert.py
    assert {a for f in FAMILIES.values() for a in f.hf_architectures} - covered_elsewhere <= built


def test_partial_rotary_is_refused(tmp_path: Path) -> None:
    _make(tmp_path / "hf", _phi3)
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["partial_rotary_factor"] = 0.5
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        convert(tmp_path / "hf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_missing_source_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _make(tmp_path / "hf", _qwen3)
    shard = next((tmp_path / "hf").glob("*.safetensors"))
    tensors = load_file(shard)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, shard)
    with pytest.raises(UnsupportedModelError, match=r"lacks 1 expected tensors, e\.g\. model\.layers\.1\.self_attn\.k_norm"):
        convert(tmp_path / "hf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_fused_tensor_too_short_for_the_config_is_refused(tmp_path: Path) -> None:
    _make(tmp_path / "hf", _phi3)
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw["intermediate_size"] *= 2  # gate_up_proj now holds half the rows the config needs
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=r"gate_up_proj.weight has 192 rows, the config needs 384"):
        convert(tmp_path / "hf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_an_artifact_of_an_unknown_family_is_refused(tmp_path: Path) -> None:
    from edgellm.artifact.config import CONFIG_FILE, ArtifactConfig
    from edgellm.errors import ArtifactError

    _make(tmp_path / "hf", _qwen3)
    art = convert(tmp_path / "hf", tmp_path / "art", quantization="q0f32", progress=False)
    raw = json.loads((art / CONFIG_FILE).read_text())
    raw["model"]["architecture"] = "mamba"
    with pytest.raises(ArtifactError, match="unknown architecture 'mamba'; known: llama, qwen2, qwen3"):
        ArtifactConfig.from_dict(raw)


def test_fused_projections_with_a_bias_on_some_only_match_float64_linears() -> None:
    """Float q/k weights fuse into one matmul; where only q has a bias, each keeps its own (not fused, no crash)."""
    from edgellm.models.blocks import FusedLinear

    g = torch.Generator().manual_seed(0)
    w = {"p.q.weight": torch.randn(8, 16, generator=g), "p.k.weight": torch.randn(4, 16, generator=g),
         "p.q.bias": torch.randn(8, generator=g)}
    x = torch.randn(3, 16, generator=g)
    q, k = FusedLinear(w, ["p.q", "p.k"], {"p.q": "f32", "p.k": "f32"})(x)
    x64 = x.double()
    assert torch.allclose(q.double(), x64 @ w["p.q.weight"].double().T + w["p.q.bias"].double(), atol=1e-5)
    assert torch.allclose(k.double(), x64 @ w["p.k.weight"].double().T, atol=1e-5)
