"""The native decoder: one call into the kernel library runs every layer for one token (a decode step), for a
chunk of tokens (prefill), or for M rows of one token each, of different sequences or of one at consecutive positions
(the batched step, :meth:`NativeDecoder.step_batch`: each row what the decode step gives for it alone).

It takes a finished model description (``el_model_desc`` of ``csrc/edgellm_decoder.h``, declared in
kernels/abi.py), which the models layer builds from the family and the weights (models/native_description.py: this
module names no tensor), and a KV cache whose arrays the native code reads and writes in place (float32, half, or
the 8-bit "q8" kind; numpy arrays of models/kv_arrays.py or torch tensors of models/kv_cache.py). Sliding-window
layers read the same full-history cache torch's path writes, from the window's first position on.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from edgellm.errors import ArtifactError
from edgellm.kernels import abi, native

DEFAULT_MAX_BATCH = 16  # rows per batched step (step_batch) unless the decoder is made with another maximum
_KV_KINDS = {"f32": abi.KV_F32, "f16": abi.KV_F16, "q8": abi.KV_Q8}  # el_kv_cache.kind of each cache kind


def as_array(t: Any) -> np.ndarray:
    """A numpy view of a weight or cache tensor: the array itself, or a CPU torch tensor's memory (not copied)."""
    return t if isinstance(t, np.ndarray) else t.detach().numpy()


def dtype_name(dtype: Any) -> str:
    """numpy's name of a numpy or torch dtype ("float32", "int8", ...); None counts as float32."""
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


# What each KV cache kind hands the native step: its arrays' dtypes, and the step function that reads them.
_CACHE_DTYPES = {"f32": ("float32", "float32"), "f16": ("float16", "float16"),
                 "q8": ("int8", "int8", "float32", "float32")}
_STEP_FUNCTIONS = {"f32": "el_decoder_step", "f16": "el_decoder_step_f16", "q8": "el_decoder_step_q8"}
_PREFILL_FUNCTIONS = {"f32": "el_decoder_prefill", "f16": "el_decoder_prefill_f16", "q8": "el_decoder_prefill_q8"}


def _cache_tensors(cache: Any) -> list[Any]:
    """Keys and values, and for q8 their scales, in the order the step function takes them (torch tensors of
    models/kv_cache.py or numpy arrays of models/kv_arrays.py)."""
    return [cache.keys, cache.values, *((cache.key_scales, cache.value_scales) if cache.kind == "q8" else ())]


def _address(t: Any) -> int:
    return t.ctypes.data if isinstance(t, np.ndarray) else t.data_ptr()


def _contiguous(t: Any) -> bool:
    return t.flags.c_contiguous if isinstance(t, np.ndarray) else t.is_contiguous()


class NativeDecoder:
    """A native decoder bound to one model's weights and its own thread pool."""

    def __init__(self, lib: ctypes.CDLL, model: abi.ModelDesc, keep_alive: object, pool: int | None, *,
                 max_batch: int = DEFAULT_MAX_BATCH) -> None:
        """`lib`: a kernel library whose signatures abi.declare set (native.load_library()); `model`: the model's C
        description (models/native_description.py builds it); `keep_alive`: whatever owns the arrays it points
        into, held as long as this decoder; `pool`: the thread pool (kernels/native.py); `max_batch`: the most rows
        a step_batch call takes (1..abi.BATCH_MAX_ROWS; its scratch is allocated at the first call)."""
        self._handle: int | None = None  # set once the description passed its checks
        self._batch: int | None = None  # the batched step's scratch (el_batch), made at the first step_batch
        if not 1 <= max_batch <= abi.BATCH_MAX_ROWS:
            raise ValueError(f"batch maximum {max_batch}: the native decoder takes 1..{abi.BATCH_MAX_ROWS} rows per "
                             "step")
        self.max_batch = max_batch
        self._model, self._keep_alive = model, keep_alive
        if code := lib.el_decoder_check(ctypes.byref(self._model)):
            raise ArtifactError(f"the native decoder refused this model description: {abi.strerror(lib, code)}")
        handle = lib.el_decoder_create(ctypes.byref(self._model), pool)
        if not handle:
            raise MemoryError("could not allocate the native decoder's scratch buffers")
        self._lib, self._handle = lib, handle
        self.vocab = model.vocab
        self.threads = lib.el_decoder_threads(handle)

    def accepts(self, cache: Any) -> bool:
        """Whether `cache` is one the native step reads and writes: batch 1, contiguous, float32 keys/values,
        the f16 kind (half keys/values) or the q8 kind (int8 keys/values, float32 scales), attending in float32."""
        if cache.kind != "f32" and dtype_name(cache.dtype) != "float32":
            return False
        tensors = _cache_tensors(cache)
        return (len(cache.keys.shape) == 5 and cache.keys.shape[1] == 1
                and all(t is not None and dtype_name(t.dtype) == d and _contiguous(t)
                        for t, d in zip(tensors, _CACHE_DTYPES[cache.kind], strict=True)))

    def step(self, token: int, pos: int, cache: Any) -> np.ndarray:
        """Logits (V,) after `token` at `pos`; its keys/values are written into `cache` (for f16: rounded
        as torch's .half(), for q8: quantized as kv_cache.quantize_q8 does, bit for bit)."""
        logits = np.empty(self.vocab, dtype=np.float32)
        step = getattr(self._lib, _STEP_FUNCTIONS[cache.kind])
        code = step(self._handle, token, pos, *(_address(t) for t in _cache_tensors(cache)), cache.keys.shape[3],
                    logits.ctypes.data)
        if code:
            raise ValueError(f"native decode step at position {pos} (token {token}): {abi.strerror(self._lib, code)}")
        return logits

    def step_batch(self, tokens: Sequence[int], positions: Sequence[int], caches: Sequence[Any]) -> np.ndarray:
        """Logits (M, V) after row i's token tokens[i] at positions[i] in caches[i], for M rows in one native call
        (csrc/decode_batch.c: the weights read once for all rows). Each row's keys/values are written into its cache
        first, as step writes them, and its logits are what step gives for it alone. Rows may share a cache (the same
        object) at consecutive positions, in row order: each attends up to its own position, the rows before it
        included. ValueError, nothing written, for: lengths that differ, M outside 1..max_batch, a cache `accepts`
        refuses, a position outside its cache's capacity or the RoPE table, a token id outside the vocabulary, rows
        of one cache not at consecutive positions, distinct caches that share memory."""
        m = len(tokens)
        where = f"native batched decode step of {m} rows"
        if len(positions) != m or len(caches) != m:
            raise ValueError(f"{where}: {len(positions)} positions and {len(caches)} caches for {m} tokens")
        if not 1 <= m <= self.max_batch:
            raise ValueError(f"{where}: takes 1..{self.max_batch} rows")
        ids = np.asarray(tokens, dtype=np.int64).reshape(m)
        pos = np.asarray(positions, dtype=np.int64).reshape(m)
        index: dict[int, int] = {}  # id(cache) -> its place in `distinct`
        distinct: list[Any] = []
        last: dict[int, int] = {}  # cache place -> the latest row's position
        for i, (token, p, cache) in enumerate(zip(ids.tolist(), pos.tolist(), caches, strict=True)):
            c = index.setdefault(id(cache), len(distinct))
            if c == len(distinct):
                if not self.accepts(cache):
                    raise ValueError(f"{where}: row {i}'s KV cache is not one the native step reads")
                distinct.append(cache)
            capacity = cache.keys.shape[3]
            if not 0 <= p < min(capacity, self._model.rope_len):
                raise ValueError(f"{where}: row {i}'s position {p} outside its KV cache (capacity {capacity}) / "
                                 f"RoPE table ({self._model.rope_len})")
            if not 0 <= token < self.vocab:  # C checks them too; here before int32 could wrap one
                raise ValueError(f"{where}: row {i}'s token id {token} outside the vocabulary")
            if c in last and p != last[c] + 1:
                raise ValueError(f"{where}: row {i} at position {p} follows position {last[c]} of the same KV cache")
            last[c] = p
        arrays = (abi.KVCacheDesc * len(distinct))()
        for c, cache in enumerate(distinct):
            t = [_address(a) for a in _cache_tensors(cache)]
            arrays[c] = abi.KVCacheDesc(t[0], t[1], *(t[2:] or (None, None)), _KV_KINDS[cache.kind],
                                        cache.keys.shape[3])
        cache_of = np.fromiter((index[id(c)] for c in caches), dtype=np.int32, count=m)
        ids32, pos32 = ids.astype(np.int32), pos.astype(np.int32)
        logits = np.empty((m, self.vocab), dtype=np.float32)
        if self._batch is None:
            self._batch = self._lib.el_batch_create(self._handle, self.max_batch)
            if not self._batch:
                raise MemoryError("could not allocate the native batched step's scratch buffers")
        code = self._lib.el_batch_step(self._batch, m, ids32.ctypes.data, pos32.ctypes.data, cache_of.ctypes.data,
                                       arrays, len(distinct), logits.ctypes.data)
        if code:
            raise ValueError(f"{where}: {abi.strerror(self._lib, code)}")
        return logits

    def prefill(self, tokens: Sequence[int], start: int, cache: Any, *, all_logits: bool = False) -> np.ndarray | None:
        """Float32 logits after `tokens` at positions start..start+n-1, run through every layer in one native call
        (csrc/decoder/prefill.c): (n, V) with `all_logits`, else the last position's (V,). Positions before `start` are read
        from `cache`, the new keys/values written into it: the caller reserves room for start + n first, as for
        step. Any kind `accepts` takes: "f32", "f16" (new keys/values rounded as torch's .half()) or "q8" (quantized
        as kv_cache.quantize_q8), bit for bit as step stores them; attention reads every position, the chunk's own
        included, as stored (as KVCache.update/read). None (nothing written) where the native prefill cannot run: a
        library without a native prefill (the scalar variant: native.prefill_matmul() is None), or a cache `accepts`
        refuses. ValueError (nothing written) for no tokens, positions beyond the cache's capacity or the RoPE table,
        a token id outside the vocabulary."""
        if not self.accepts(cache):
            return None
        prefill = getattr(self._lib, _PREFILL_FUNCTIONS[cache.kind])
        n = len(tokens)
        where = f"native prefill at positions {start}..{start + n - 1}"
        if n == 0:
            raise ValueError(f"native prefill at position {start}: no tokens")
        ids = np.asarray(tokens, dtype=np.int64).reshape(n)
        outside = ids[(ids < 0) | (ids >= self.vocab)]  # C checks them too; here before int32 could wrap one
        if outside.size:
            raise ValueError(f"{where}: token id {int(outside[0])} outside the vocabulary")
        ids = ids.astype(np.int32)  # int32 tokens[n]
        logits = np.empty((n if all_logits else 1, self.vocab), dtype=np.float32)  # float32 [n or 1][V], row-major
        # keys, values [layers][1][kv_heads][capacity][head_dim] (float32, half or int8), q8's scales [...][capacity][1]
        arrays = [_address(t) for t in _cache_tensors(cache)]
        capacity = cache.keys.shape[3]
        code = prefill(self._handle, ids.ctypes.data, n, start, *arrays, capacity, logits.ctypes.data, int(all_logits))
        if code == abi.ERR_UNAVAILABLE:  # no native prefill in this library: checked before anything is written
            return None
        if code:
            limit = f" (cache capacity {capacity}, RoPE table {self._model.rope_len})" * (code == abi.ERR_POSITION)
            raise ValueError(f"{where}: {abi.strerror(self._lib, code)}{limit}")
        return logits if all_logits else logits[0]

    def describe(self) -> str:
        """The decode path in words: "native <variant>, N threads"."""
        return f"native {native.active_kernel()[0]}, {self.threads} thread{'s' * (self.threads > 1)}"

    def close(self) -> None:
        """Free the scratch buffers (the weights belong to the artifact, the pool to edgellm.kernels.native)."""
        if self._batch:
            self._lib.el_batch_destroy(self._batch)
            self._batch = None
        if self._handle:
            self._lib.el_decoder_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()

