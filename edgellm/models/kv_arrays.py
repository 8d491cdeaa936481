"""The KV cache of a model run by the native decoder alone (models/native_model.py): keys and values in numpy
arrays (float32, half, or int8 with float32 scales: the kinds of models/kv_cache.py, bit for bit the same
layout), grown as models/kv_space.py says; the native prefill and decode step read and write them in place."""

from __future__ import annotations

import numpy as np

from edgellm.models.kv_space import DEFAULT_BLOCK, KVSpace


class ArrayKVCache(KVSpace):
    """Keys and values (layers, 1, kv_heads, capacity, head_dim) of one `kind` in numpy arrays."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_length: int, *, kind: str = "f32",
                 initial: int | None = None, block: int = DEFAULT_BLOCK) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, max_length, dtype=np.dtype(np.float32), kind=kind,
                         initial=initial, block=block)

    def _new(self, shape: tuple[int, ...], dtype: str | None) -> np.ndarray:
        return np.empty(shape, dtype=np.dtype(dtype or "float32"))
