"""Gemma 2: (1 + w) RMSNorm before and after attention and MLP, GELU-tanh, √d embedding scale,
alternating sliding-window layers, soft-capped attention scores and output logits."""

from __future__ import annotations

from typing import Any

from edgellm.families.config import FULL, SLIDING
from edgellm.families.family import Family, GGUFMeta, layer_pattern


class Gemma2(Family):
    name = "gemma2"
    hf_architectures = ("Gemma2ForCausalLM",)
    gguf_architecture = "gemma2"
    norm_offset = 1.0
    sandwich_norms = True
    embed_scale = True
    sliding_every = 2  # every second layer attends to all keys
    big_layer_count = 46  # the 27B model: llama.cpp scales its queries by hidden/heads, not head_dim

    def extra_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        n = raw["num_hidden_layers"]
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        return {
            "hidden_act": "gelu_tanh" if act in ("gelu_pytorch_tanh", "gelu_tanh") else act,
            "layer_types": tuple(raw.get("layer_types") or layer_pattern(n, raw.get("sliding_window_pattern")
                                                                          or self.sliding_every)),
            "sliding_window": raw.get("sliding_window"),
            "query_pre_attn_scalar": raw.get("query_pre_attn_scalar"),
            "attn_logit_softcapping": raw.get("attn_logit_softcapping"),
            "final_logit_softcapping": raw.get("final_logit_softcapping"),
        }

    def extra_gguf(self, meta: GGUFMeta) -> dict[str, Any]:
        n, heads = int(meta.require("block_count")), int(meta.require("attention.head_count"))
        hidden = int(meta.require("embedding_length"))
        scalar = hidden // heads if n == self.big_layer_count else meta.get("attention.key_length", hidden // heads)
        return {
            "hidden_act": "gelu_tanh",
            "layer_types": self._gguf_layer_types(meta, n),
            "sliding_window": int(meta.require("attention.sliding_window")),
            "query_pre_attn_scalar": float(scalar),
            "attn_logit_softcapping": meta.get("attn_logit_softcapping"),
            "final_logit_softcapping": meta.get("final_logit_softcapping"),
        }

    def _gguf_layer_types(self, meta: GGUFMeta, n: int) -> tuple[str, ...]:
        """llama.cpp's `attention.sliding_window_pattern`: every N-th layer full, or one bool per layer
        (True: sliding); the family's own pattern when the file does not say."""
        pattern = meta.get("attention.sliding_window_pattern", self.sliding_every)
        if isinstance(pattern, list):
            return tuple(SLIDING if pattern[i % len(pattern)] else FULL for i in range(n))
        return layer_pattern(n, int(pattern))

    def gguf_block_names(self) -> dict[str, str]:
        return {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
