"""The GGUF side of each family: a tiny random model written as llama.cpp would write it (its tensor names,
fused Phi-3 projections, Gemma's 1 + w norms, its metadata keys), converted by edgellm at q0f32, must give
transformers' logits for the original model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.runtime.engine import Engine
from tests.families.test_families import IDS, _gemma3, _hf_logits, _make, _phi3, _qwen3
from tests.support.gguf_writer import add_placeholder_vocab, add_shape
from tests.support.tiny import VOCAB

transformers = pytest.importorskip("transformers")

_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gemma2_gguf() -> Any:  # llama.cpp scales queries by head_dim, so the tiny model must too
    cfg = transformers.Gemma2Config(num_hidden_layers=4, query_pre_attn_scalar=16, sliding_window=8,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                                    rms_norm_eps=1e-6, pad_token_id=0)
    return transformers.Gemma2ForCausalLM(cfg)


def _gguf_name(hf: str, gemma: bool) -> str:
    stem, _, kind = hf.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    _, _, i, role = stem.split(".", 3)
    if role == "post_attention_layernorm" and not gemma:
        return f"blk.{i}.ffn_norm.{kind}"
    return f"blk.{i}.{(_GEMMA_NORMS | _BLOCK)[role] if gemma else _BLOCK[role]}.{kind}"


def _write_gguf(model: Any, arch: str, path: Path) -> None:
    cfg, gemma = model.config, arch.startswith("gemma")
    w = gguf.GGUFWriter(str(path), arch)
    add_shape(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    add_placeholder_vocab(w, VOCAB)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float()
        if gemma and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp stores Gemma's norms as 1 + w
        w.add_tensor(_gguf_name(name, gemma), data.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,build", [("qwen3", _qwen3), ("gemma2", _gemma2_gguf), ("gemma3", _gemma3),
                                        ("phi3", _phi3)])
def test_gguf_convert_matches_transformers(tmp_path: Path, arch: str, build: Any) -> None:
    ref = _make(tmp_path / "hf", build)
    _write_gguf(ref, arch, tmp_path / "tiny.gguf")
    art = convert(tmp_path / "tiny.gguf", tmp_path / "art", quantization="q0f32", progress=False, prefill_chunk_size=7)
    engine = Engine(open_artifact(art), threads=1)
    assert engine.config.model.architecture == arch
    assert (engine.logits(IDS[0].tolist()) - _hf_logits(ref, IDS, 7)).abs().max().item() <= 1e-4
