"""Context shift: when a generation fills the window, drop the oldest tokens after a kept head and go on.

Two ways, chosen per request (`GenerationParams.context_shift`):

- ``"reencode"``: the kept head plus the newest half of the window is run through the model again (the
  head's keys/values are reused). Exact: the cache is what a fresh prefill of those tokens gives.
- ``"rope"``: the newest half's keys/values move down in the cache and the keys are re-rotated by the
  distance moved (RoPE rotations compose). Only a copy, but approximate: the kept tokens' keys still carry
  what the dropped tokens contributed in earlier layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgellm.errors import EdgeLLMError
from edgellm.models.kv_cache import KVCache

if TYPE_CHECKING:
    from edgellm.models.transformer import Transformer

SHIFT_METHODS = ("reencode", "rope")
DEFAULT_KEEP = 4  # tokens always kept at the start (the BOS / attention-sink tokens of a plain prompt)


def check_method(method: str) -> str:
    """`method` itself if it names a shift method; EdgeLLMError naming the known ones otherwise."""
    if method not in SHIFT_METHODS:
        raise EdgeLLMError(f"unknown context shift {method!r}; known: {', '.join(SHIFT_METHODS)}")
    return method


def shifted_ids(cached: list[int], window: int, keep: int) -> tuple[list[int], int, int]:
    """(ids kept after a shift, head length, number dropped): the head `keep` tokens and the newest half."""
    keep = max(0, min(keep, window // 2))
    drop = max(1, (len(cached) - keep) // 2)
    return cached[:keep] + cached[keep + drop :], keep, drop


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE by the angle whose cos/sin rows are given, (head_dim,) each, applied to (..., head_dim)."""
    half = keys.shape[-1] // 2
    rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos + rotated * sin


def rope_shift_exact(model: Transformer) -> bool:
    """Whether re-rotating keys moves them exactly: one RoPE table, angles linear in the position, no scale
    (LongRoPE switches tables and scales; Gemma 3's sliding layers use a second base)."""
    return model.local_rope is None and model.rope.switch_at is None


@torch.inference_mode()  # the cache's tensors may have been (re)allocated inside the model's inference mode
def shift_cache(cache: KVCache, model: Transformer, end: int, keep: int, drop: int) -> None:
    """Move positions keep+drop..end-1 to keep.. and re-rotate their keys back by `drop` positions."""
    cos, sin = model.rope.short_cos[drop], -model.rope.short_sin[drop]  # rotation by -drop: cos even, sin odd
    for layer in range(len(model.layers)):
        keys, values = cache.read(layer, end)
        tail_k = rotate_keys(keys[:, :, keep + drop : end].float(), cos, sin).to(keys.dtype)
        tail_v = values[:, :, keep + drop : end].clone()
        cache.update(layer, keep, tail_k, tail_v)
