"""The key/value cache: float, half or 8-bit, allocated for what the request needs and grown in blocks.

Layout (every kind): ``keys``/``values`` are contiguous tensors (layers, batch, kv_heads, capacity, head_dim).
``capacity`` grows (reallocate + copy, doubling, in multiples of ``block``) up to ``max_length``, the
context window. ``kind`` says how to read them: ``"f32"`` (the float dtype given, float32 by default: a
native decode step may read ``keys``/``values`` directly after ``reserve``), ``"f16"`` (IEEE half, as
llama.cpp keeps it by default: half the memory, read back as the float dtype; new positions are rounded
to nearest even by torch and the native step alike) or ``"q8"`` (int8, symmetric,
one float32 scale per token per head in ``key_scales``/``value_scales``, (layers, batch, kv_heads,
capacity, 1); torch's attention reads it dequantized through ``update``, the native decode step reads
and writes the int8 rows and scales in place, quantizing new positions exactly as ``quantize_q8``).
"""

from __future__ import annotations

import torch

from edgellm.models.config import check_kv_kind

DEFAULT_BLOCK = 256
_Q8_MAX = 127.0


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kind: str = "f32",
                    dtype: torch.dtype = torch.float32) -> int:
    """Keys + values of one token position across all layers and heads."""
    kind = check_kv_kind(kind)
    per_head = head_dim + 4 if kind == "q8" else head_dim * (2 if kind == "f16" else dtype.itemsize)  # q8: + a scale
    return 2 * num_layers * num_kv_heads * per_head


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 along the last dim: (int8 values, float32 scale with a trailing dim of 1)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float() / _Q8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp_(-_Q8_MAX, _Q8_MAX).to(torch.int8), scale


class KVCache:
    """Keys and values of every layer for one sequence: (layers, batch, kv_heads, capacity, head_dim)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        kind: str = "f32",
        initial: int | None = None,
        block: int = DEFAULT_BLOCK,
    ) -> None:
        """`initial` tokens are allocated now (default: one block); None with block=0 means the full window."""
        self.kind = check_kv_kind(kind)
        self.max_length = max_length
        self.block = block
        self.dtype = dtype  # the float dtype attention works in (and f32 storage uses)
        self._dims = (num_layers, batch, num_kv_heads)
        self._head_dim = head_dim
        start = max_length if block <= 0 else min(max_length, initial if initial is not None else block)
        self.keys, self.values, self.key_scales, self.value_scales = self._allocate(start)
        self.capacity = start

    @staticmethod
    def bytes_needed(num_layers: int, num_kv_heads: int, head_dim: int, max_length: int,
                     dtype: torch.dtype = torch.float32, batch: int = 1, kind: str = "f32") -> int:
        """Bytes for `max_length` positions (the most this cache can grow to)."""
        return batch * max_length * bytes_per_token(num_layers, num_kv_heads, head_dim, kind, dtype)

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (grows with the conversation)."""
        scales = self.key_scales.numel() * 4 * 2 if self.key_scales is not None else 0
        return 2 * self.keys.numel() * self.keys.element_size() + scales

    def _allocate(self, capacity: int):
        """Uninitialized: positions are only read after they are written, and untouched pages of a fresh
        allocation cost no resident memory (a request's reserve beyond what it fills, the first block)."""
        shape = (*self._dims, capacity, self._head_dim)
        if self.kind == "q8":
            scale_shape = (*self._dims, capacity, 1)
            return (torch.empty(shape, dtype=torch.int8), torch.empty(shape, dtype=torch.int8),
                    torch.empty(scale_shape), torch.empty(scale_shape))
        store = torch.float16 if self.kind == "f16" else self.dtype
        return torch.empty(shape, dtype=store), torch.empty(shape, dtype=store), None, None

    def reserve(self, end: int) -> None:
        """Make room for positions 0..end-1: grow to max(end, 2×capacity) in whole blocks, capped at the window."""
        if end <= self.capacity:
            return
        if end > self.max_length:
            raise ValueError(f"position {end} exceeds the context window {self.max_length}")
        block = max(self.block, 1)
        want = max(end, 2 * self.capacity)
        new = min(self.max_length, -(-want // block) * block)
        old = self.capacity
        fresh = self._allocate(new)
        for dst, src in zip(fresh, (self.keys, self.values, self.key_scales, self.value_scales)):
            if src is not None:
                dst[..., :old, :] = src[..., :old, :]
        self.keys, self.values, self.key_scales, self.value_scales = fresh
        self.capacity = new

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, kv_heads, T, head_dim) at positions start..start+T; return the filled prefix as floats."""
        end = start + k.shape[2]
        self.reserve(end)
        if self.kind != "q8":  # f16: torch's rounding to nearest even, as the native step's
            self.keys[layer, :, :, start:end] = k
            self.values[layer, :, :, start:end] = v
            return self.read(layer, end)
        assert self.key_scales is not None and self.value_scales is not None
        self.keys[layer, :, :, start:end], self.key_scales[layer, :, :, start:end] = quantize_q8(k)
        self.values[layer, :, :, start:end], self.value_scales[layer, :, :, start:end] = quantize_q8(v)
        return self.read(layer, end)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..end-1 of `layer`, as floats (B, kv_heads, end, head_dim)."""
        if self.kind == "f32":
            return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        if self.kind == "f16":
            return self.keys[layer, :, :, :end].to(self.dtype), self.values[layer, :, :, :end].to(self.dtype)
        assert self.key_scales is not None and self.value_scales is not None
        keys = self.keys[layer, :, :, :end].to(self.dtype) * self.key_scales[layer, :, :, :end]
        values = self.values[layer, :, :, :end].to(self.dtype) * self.value_scales[layer, :, :, :end]
        return keys, values

    def shrink(self) -> None:
        """Drop everything and go back to one block (a rebuilt session starts small again)."""
        if self.block > 0 and self.capacity > self.block:
            self.capacity = min(self.max_length, self.block)
            self.keys, self.values, self.key_scales, self.value_scales = self._allocate(self.capacity)

    def release(self) -> None:
        """Free the cache's memory now rather than at garbage collection."""
        self.keys = self.values = torch.empty(0)
        self.key_scales = self.value_scales = None
        self.max_length = self.capacity = 0
