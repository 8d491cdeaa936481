"""A static, preallocated key/value cache sized from the context window."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer for one sequence: (layers, batch, kv_heads, context, head_dim)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, max_length, head_dim)
        self.max_length = max_length
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)

    @staticmethod
    def bytes_needed(num_layers: int, num_kv_heads: int, head_dim: int, max_length: int,
                     dtype: torch.dtype = torch.float32, batch: int = 1) -> int:
        return 2 * num_layers * batch * num_kv_heads * max_length * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, kv_heads, T, head_dim) at positions start..start+T; return the filled prefix."""
        end = start + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def release(self) -> None:
        """Free the cache's memory now rather than at garbage collection."""
        self.keys = self.values = torch.empty(0)
        self.max_length = 0
