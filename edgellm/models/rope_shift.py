"""The "rope" context shift on torch's path (session/context.py): move the newest keys/values down the cache and
re-rotate the keys by the distance moved."""

from __future__ import annotations

import torch

from edgellm.models.blocks import Rope
from edgellm.models.kv_cache import KVCache


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE by the angle whose cos/sin rows are given, (head_dim,) each, applied to (..., head_dim)."""
    half = keys.shape[-1] // 2
    rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos + rotated * sin


def rope_shift_exact(rope: Rope, local_rope: Rope | None) -> bool:
    """Whether re-rotating keys moves them exactly for a model with these RoPE tables: one table, angles linear in
    the position, no scale (LongRoPE switches tables and scales; Gemma 3's sliding layers use a second base)."""
    return local_rope is None and rope.switch_at is None


@torch.inference_mode()  # the cache's tensors may have been (re)allocated inside the model's inference mode
def shift_cache(cache: KVCache, rope: Rope, end: int, keep: int, drop: int) -> None:
    """Move positions keep+drop..end-1 to keep.. in every layer of `cache` and re-rotate their keys back by `drop`
    positions of `rope` (the model's one table: rope_shift_exact)."""
    cos, sin = rope.tables(drop, 1)
    cos, sin = cos[0], -sin[0]  # rotation by -drop: cos even, sin odd
    for layer in range(cache.keys.shape[0]):  # keys: [layers][batch][kv_heads][capacity][head_dim]
        keys, values = cache.read(layer, end)
        tail_k = rotate_keys(keys[:, :, keep + drop : end].float(), cos, sin).to(keys.dtype)
        tail_v = values[:, :, keep + drop : end].clone()
        cache.update(layer, keep, tail_k, tail_v)
