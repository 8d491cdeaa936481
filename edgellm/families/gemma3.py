"""Gemma 3 (text): Gemma 2's layout with q/k RMSNorm, five sliding layers per full one, a RoPE base of its own
for the sliding layers, and no soft-capping of attention scores (only of the output logits, if configured)."""

from __future__ import annotations

from typing import Any

from edgellm.errors import UnsupportedModelError
from edgellm.families.config import SLIDING
from edgellm.families.family import GGUFMeta, hf_rope
from edgellm.families.gemma2 import Gemma2

LOCAL_THETA = 10_000.0  # Gemma 3's sliding-layer RoPE base when the config does not say


class Gemma3(Gemma2):
    name = "gemma3"
    hf_architectures = ("Gemma3ForCausalLM",)
    gguf_architecture = "gemma3"
    qk_norm = True
    sliding_every = 6
    big_layer_count = 62

    def extra_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        local = raw.get("rope_local_base_freq")
        if local is None:
            local = ((raw.get("rope_parameters") or {}).get(SLIDING) or {}).get("rope_theta", LOCAL_THETA)
        if hf_rope(raw, SLIDING)[1] is not None:
            raise UnsupportedModelError("scaled RoPE on Gemma 3's sliding layers is not supported")
        # Gemma 3 configs may carry attn_logit_softcapping, but its attention never applies it (transformers).
        return super().extra_hf(raw) | {"rope_local_theta": float(local), "attn_logit_softcapping": None}

    def extra_gguf(self, meta: GGUFMeta) -> dict[str, Any]:
        return super().extra_gguf(meta) | {"rope_local_theta": float(meta.get("rope.freq_base_swa", LOCAL_THETA)),
                                           "attn_logit_softcapping": None}
