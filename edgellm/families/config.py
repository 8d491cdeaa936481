"""Hyper-parameters of a decoder-only transformer: what every family reads from its source and the artifact keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgellm.errors import ArtifactError, EdgeLLMError

SLIDING = "sliding_attention"
FULL = "full_attention"
KV_KINDS = ("f32", "f16", "q8")  # KV cache kinds (models/kv_cache.py): float32, IEEE half, int8 with scales


def check_kv_kind(kind: str) -> str:
    """`kind` itself if it names a KV cache kind; EdgeLLMError naming the known kinds otherwise."""
    if kind not in KV_KINDS:
        raise EdgeLLMError(f"unknown KV cache kind {kind!r}; known kinds: {', '.join(KV_KINDS)}")
    return kind


@dataclass(frozen=True)
class ModelConfig:
    """Named after Hugging Face's config keys. Fields after `attention_bias` default to Llama behaviour, so
    artifacts written before they existed still load."""

    architecture: str  # a family name from edgellm.families.registry ("llama", "qwen2", "gemma3", ...)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" or "gelu_tanh"
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; empty: every layer attends to all keys
    sliding_window: int | None = None  # keys a sliding layer sees, itself included
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (head_dim's when None)
    attn_logit_softcapping: float | None = None  # scores → cap·tanh(scores/cap) (Gemma 2)
    final_logit_softcapping: float | None = None
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3"|"longrope", ...}
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ArtifactError("num_attention_heads must be a multiple of num_key_value_heads")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ArtifactError(f"layer_types names {len(self.layer_types)} layers, the model has "
                                f"{self.num_hidden_layers}")
        if any(t not in (SLIDING, FULL) for t in self.layer_types):
            raise ArtifactError(f"layer_types may hold only {SLIDING!r} and {FULL!r}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ArtifactError("sliding layers need a sliding_window")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ArtifactError(f"unknown activation {self.hidden_act!r}")

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING
