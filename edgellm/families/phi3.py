"""Phi-3: the Llama layout with fused qkv_proj and gate_up_proj (split into the usual projections on
convert), every layer sliding when the config has a window, LongRoPE where configured."""

from __future__ import annotations

from typing import Any

from edgellm.families.config import SLIDING, ModelConfig
from edgellm.families.family import ATTN, MLP, Family, GGUFMeta, SourceTensor


class Phi3(Family):
    name = "phi3"
    hf_architectures = ("Phi3ForCausalLM",)
    gguf_architecture = "phi3"

    def extra_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        window = raw.get("sliding_window")
        return {"sliding_window": window, "layer_types": (SLIDING,) * raw["num_hidden_layers"] if window else ()}

    def extra_gguf(self, meta: GGUFMeta) -> dict[str, Any]:
        window = meta.get("attention.sliding_window")
        n = int(meta.require("block_count"))
        return {"sliding_window": int(window) if window else None, "layer_types": (SLIDING,) * n if window else ()}

    def _fused(self, cfg: ModelConfig, qkv: str, gate_up: str) -> dict[str, SourceTensor]:
        """Row ranges of q/k/v in the fused qkv tensor and of gate/up in the fused gate_up tensor."""
        q, kv, f = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
        out: dict[str, SourceTensor] = {}
        for i in range(cfg.num_hidden_layers):
            p, src_qkv, src_gu = f"model.layers.{i}", qkv.format(i=i), gate_up.format(i=i)
            out |= {f"{p}.{ATTN}.q_proj.weight": SourceTensor(src_qkv, (0, q)),
                    f"{p}.{ATTN}.k_proj.weight": SourceTensor(src_qkv, (q, q + kv)),
                    f"{p}.{ATTN}.v_proj.weight": SourceTensor(src_qkv, (q + kv, q + 2 * kv)),
                    f"{p}.{MLP}.gate_proj.weight": SourceTensor(src_gu, (0, f)),
                    f"{p}.{MLP}.up_proj.weight": SourceTensor(src_gu, (f, 2 * f))}
        return out

    def hf_sources(self, cfg: ModelConfig) -> dict[str, SourceTensor]:
        return super().hf_sources(cfg) | self._fused(cfg, "model.layers.{i}.self_attn.qkv_proj.weight",
                                                     "model.layers.{i}.mlp.gate_up_proj.weight")

    def gguf_sources(self, cfg: ModelConfig) -> dict[str, SourceTensor]:
        return super().gguf_sources(cfg) | self._fused(cfg, "blk.{i}.attn_qkv.weight", "blk.{i}.ffn_up.weight")
