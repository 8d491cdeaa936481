"""The decoder every family runs: embeddings, layers of attention + gated MLP, final norm and output head.

What differs between families (norm placement and offset, q/k norms, embedding scale, soft-capping,
sliding layers, RoPE variant) comes from the family and the ModelConfig; the weights are the artifact's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from edgellm.models.blocks import Attention, GatedMLP, RMSNorm, Rope, Weights, parts
from edgellm.families.config import ModelConfig
from edgellm.models.kv_cache import DEFAULT_BLOCK, KVCache
from edgellm.models.kv_space import KVSpace
from edgellm.models.protocol import decode_batch_by_run
from edgellm.families.registry import family_of
from edgellm.models.rope_shift import rope_shift_exact, shift_cache
from edgellm.families.tensor_specs import check_tensors, spec_of
from edgellm.quant.layers import make_embedding, make_linear

if TYPE_CHECKING:
    from edgellm.artifact.config import ArtifactConfig
    from edgellm.families.family import Family


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; with `sandwich` norms (Gemma) their outputs are normed too."""

    def __init__(self, family: Family, cfg: ModelConfig, weights: Weights, i: int, formats: dict[str, str]) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        self.index = i
        self.sliding = cfg.is_sliding(i)
        offset = family.norm_offset

        def norm(name: str) -> RMSNorm:
            return RMSNorm(weights[f"{p}.{name}.weight"], cfg.rms_norm_eps, offset)

        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.attn = Attention(prefix=f"{p}.self_attn", weights=weights, formats=formats,
                              n_heads=cfg.num_attention_heads, n_kv=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                              scale=scale, qk_norm=(cfg.rms_norm_eps, offset) if family.qk_norm else None,
                              window=cfg.sliding_window if self.sliding else None,
                              softcap=cfg.attn_logit_softcapping)
        self.mlp = GatedMLP(weights, f"{p}.mlp", formats, cfg.hidden_act)
        self.input_norm = norm("input_layernorm")
        self.attn_out_norm: RMSNorm | None = None  # sandwich norms only
        self.mlp_out_norm: RMSNorm | None = None
        if family.sandwich_norms:
            self.attn_out_norm = norm("post_attention_layernorm")
            self.post_norm = norm("pre_feedforward_layernorm")
            self.mlp_out_norm = norm("post_feedforward_layernorm")
        else:
            self.post_norm = norm("post_attention_layernorm")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int):
        a = self.attn(self.input_norm(x), cos, sin, cache, self.index, start)
        h = x + (a if self.attn_out_norm is None else self.attn_out_norm(a))
        m = self.mlp(self.post_norm(h))
        return h + (m if self.mlp_out_norm is None else self.mlp_out_norm(m))


class Transformer(nn.Module):
    """Decoder-only transformer on torch (a Model, models/protocol.py); `forward` reads and extends the KV cache
    passed in. torch runs every token: models/torch_native.py gives its decode steps to the native library."""

    chunk_invariant = False  # a prompt's bits depend on how it is chunked (torch's GEMMs by shape)

    def __init__(self, config: ArtifactConfig, weights: Weights, *, kv_dtype: torch.dtype = torch.float32) -> None:
        """`kv_dtype`: the float type its caches store the f32 KV kind in (and attend in)."""
        super().__init__()
        # a native decode step beside it (models/torch_native.py) reads these weights through bare pointers
        check_tensors(config, {name: spec_of(t) for name, t in weights.items()}, where="model")
        family = self.family = family_of(config.model.architecture)
        cfg = self.config = config.model
        formats = config.quantization.formats
        embed_fmt = formats["model.embed_tokens"]
        embed_parts = parts(weights, "model.embed_tokens", embed_fmt)
        self.embed = make_embedding(embed_fmt, embed_parts)
        self.embed_scale = cfg.hidden_size**0.5 if family.embed_scale else None
        self.layers = nn.ModuleList(DecoderLayer(family, cfg, weights, i, formats) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(weights["model.norm.weight"], cfg.rms_norm_eps, family.norm_offset)
        if cfg.tie_word_embeddings:
            self.lm_head = make_linear(embed_fmt, embed_parts, None)
        else:
            self.lm_head = make_linear(formats["lm_head"], parts(weights, "lm_head", formats["lm_head"]), None)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, config.context_window,
                         cfg.max_position_embeddings)
        self.local_rope = None
        if cfg.rope_local_theta is not None:
            self.local_rope = Rope(cfg.head_dim, cfg.rope_local_theta, None, config.context_window,
                                   cfg.max_position_embeddings)
        self.kv_dtype = kv_dtype

    def new_cache(self, max_length: int, *, kind: str = "f32", block: int = DEFAULT_BLOCK,
                  dtype: torch.dtype | None = None, batch: int = 1) -> KVCache:
        """A cache of `batch` sequences, its f32 kind stored in `dtype` (the model's kv_dtype when None)."""
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_length,
                       batch=batch, dtype=dtype or self.kv_dtype, kind=kind, block=block)

    def run(self, ids: Sequence[int], start: int, cache: KVSpace, *, all_logits: bool = False) -> np.ndarray:
        """What the generation session calls: `ids` at positions start.. → float32 logits (T, V) with
        `all_logits`, else the last position's (V,)."""
        logits = self(torch.tensor([list(ids)]), start, _torch_cache(cache), all_logits=all_logits)[0]
        return (logits if all_logits else logits[-1]).float().numpy()

    def decode_batch(self, tokens: Sequence[int], positions: Sequence[int], caches: Sequence[KVSpace]) -> np.ndarray:
        return decode_batch_by_run(self, tokens, positions, caches)

    def shift_cache(self, cache: KVSpace, end: int, keep: int, drop: int) -> bool:
        """The "rope" context shift (models/rope_shift.py), where re-rotating the keys is exact; False otherwise."""
        if not rope_shift_exact(self.rope, self.local_rope):
            return False
        shift_cache(_torch_cache(cache), self.rope, end, keep, drop)
        return True

    def streamed_spans(self) -> list[tuple[int, int]]:
        """None: torch's decode reads its own prepared copies of the weights, not the mapped ones."""
        return []

    def describe(self) -> str:
        return "torch"

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, *, all_logits: bool = False) -> torch.Tensor:
        """tokens (B, T) at positions start..start+T → logits (B, T, V) if all_logits else (B, 1, V)."""
        t = tokens.shape[1]
        if start + t > min(cache.max_length, self.rope.length):
            raise ValueError(f"positions {start}..{start + t} exceed the context window {cache.max_length}")
        cos, sin = self.rope.tables(start, t)  # (T, hd)
        local = self.local_rope.tables(start, t) if self.local_rope is not None else (cos, sin)
        x = self.embed(tokens)  # (B, T, D)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for layer in self.layers:
            x = layer(x, *(local if layer.sliding else (cos, sin)), cache, start)
        if not all_logits:
            x = x[:, -1:]
        logits = self.lm_head(self.norm(x))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _torch_cache(cache: KVSpace) -> KVCache:
    """`cache` as torch's path reads it: a KVCache of torch tensors (TypeError for another kind of cache)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"torch's Transformer reads a KVCache, not {type(cache).__name__}")
    return cache
