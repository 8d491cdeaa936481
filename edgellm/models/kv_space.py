"""What every KV cache shares, whatever holds its memory (torch tensors in models/kv_cache.py, numpy arrays in
models/kv_arrays.py): its sizes, and growing in blocks up to the context window.

Layout (every kind): ``keys``/``values`` are contiguous (layers, batch, kv_heads, capacity, head_dim). ``capacity``
grows (reallocate + copy, doubling, in multiples of ``block``) up to ``max_length``, the context window.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from edgellm.families.config import check_kv_kind

DEFAULT_BLOCK = 256


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kind: str = "f32", dtype: Any = None) -> int:
    """Keys + values of one token position across all layers and heads (`dtype`: f32 storage's float type, a
    torch or numpy dtype; float32 when None)."""
    kind = check_kv_kind(kind)
    itemsize = 4 if dtype is None else dtype.itemsize
    per_head = head_dim + 4 if kind == "q8" else head_dim * (2 if kind == "f16" else itemsize)  # q8: + a scale
    return 2 * num_layers * num_kv_heads * per_head


class KVSpace(ABC):
    """Keys and values of every layer for one sequence, and how they grow; subclasses allocate the memory."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_length: int, *, batch: int = 1,
                 dtype: Any, kind: str = "f32", initial: int | None = None, block: int = DEFAULT_BLOCK) -> None:
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
    def bytes_needed(num_layers: int, num_kv_heads: int, head_dim: int, max_length: int, dtype: Any = None,
                     batch: int = 1, kind: str = "f32") -> int:
        """Bytes for `max_length` positions (the most this cache can grow to)."""
        return batch * max_length * bytes_per_token(num_layers, num_kv_heads, head_dim, kind, dtype)

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (grows with the conversation)."""
        scales = self.key_scales.nbytes * 2 if self.key_scales is not None else 0
        return 2 * self.keys.nbytes + scales

    def _allocate(self, capacity: int) -> tuple[Any, Any, Any, Any]:
        """Uninitialized keys, values (and for q8 their scales, else None) for `capacity` positions: positions are
        only read after they are written, and untouched pages of a fresh allocation cost no resident memory."""
        shape = (*self._dims, capacity, self._head_dim)
        if self.kind == "q8":
            scale_shape = (*self._dims, capacity, 1)
            return (self._new(shape, "int8"), self._new(shape, "int8"), self._new(scale_shape, "float32"),
                    self._new(scale_shape, "float32"))
        store = "float16" if self.kind == "f16" else None
        return self._new(shape, store), self._new(shape, store), None, None

    @abstractmethod
    def _new(self, shape: tuple[int, ...], dtype: str | None) -> Any:
        """An uninitialized array of the subclass's kind; `dtype` by numpy's name, None for the cache's float type."""

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

    def shrink(self) -> None:
        """Drop everything and go back to one block (a rebuilt session starts small again)."""
        if self.block > 0 and self.capacity > self.block:
            self.capacity = min(self.max_length, self.block)
            self.keys, self.values, self.key_scales, self.value_scales = self._allocate(self.capacity)

    def release(self) -> None:
        """Free the cache's memory now rather than at garbage collection."""
        self.keys = self.values = self._new((0,), None)
        self.key_scales = self.value_scales = None
        self.max_length = self.capacity = 0
