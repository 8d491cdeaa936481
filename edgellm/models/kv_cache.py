"""The key/value cache in torch tensors: float, half or 8-bit, allocated for what the request needs and grown in
blocks (models/kv_space.py has the layout and the growth).

``kind`` says how to read ``keys``/``values``: ``"f32"`` (the float dtype given, float32 by default: a
native decode step may read ``keys``/``values`` directly after ``reserve``), ``"f16"`` (IEEE half, as
llama.cpp keeps it by default: half the memory, read back as the float dtype; new positions are rounded
to nearest even by torch and the native step alike) or ``"q8"`` (int8, symmetric,
one float32 scale per token per head in ``key_scales``/``value_scales``, (layers, batch, kv_heads,
capacity, 1); torch's attention reads it dequantized through ``update``, the native decode step reads
and writes the int8 rows and scales in place, quantizing new positions exactly as ``quantize_q8``).
"""

from __future__ import annotations

import torch

from edgellm.models.kv_space import DEFAULT_BLOCK, KVSpace, bytes_per_token  # noqa: F401 (re-exported)

_Q8_MAX = 127.0


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 along the last dim: (int8 values, float32 scale with a trailing dim of 1)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float() / _Q8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp_(-_Q8_MAX, _Q8_MAX).to(torch.int8), scale


class KVCache(KVSpace):
    """Keys and values of every layer for one sequence in torch tensors (layers, batch, kv_heads, capacity,
    head_dim)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_length: int, *, batch: int = 1,
                 dtype: torch.dtype = torch.float32, kind: str = "f32", initial: int | None = None,
                 block: int = DEFAULT_BLOCK) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, max_length, batch=batch, dtype=dtype, kind=kind,
                         initial=initial, block=block)

    def _new(self, shape: tuple[int, ...], dtype: str | None) -> torch.Tensor:
        return torch.empty(shape, dtype=getattr(torch, dtype) if dtype else self.dtype)


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
