"""A model run by the native library alone (a Model, models/protocol.py): prefill chunks and decode steps through
one NativeDecoder (kernels/decoder.py), its KV cache in numpy arrays (models/kv_arrays.py), and no torch in the
process (whose import alone is 218 MiB of resident memory — more than llama.cpp's whole process on SmolLM2-135M).

models/protocol.py's `choose` picks it where the artifact decodes natively and the library can prefill (every SIMD
variant: the AVX512-BF16 GEMM where the CPU has it, else the float32 one), or, asked for it (runtime "native"),
where it cannot (the scalar variant): prompts then go through the decode step token by token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from edgellm.kernels import native
from edgellm.kernels.decoder import DEFAULT_MAX_BATCH
from edgellm.models.kv_arrays import ArrayKVCache
from edgellm.models.kv_space import DEFAULT_BLOCK, KVSpace
from edgellm.models.native_description import NativeDescription, native_decoder
from edgellm.families.registry import family_of
from edgellm.models.rope_tables import rope_tables
from edgellm.families.tensor_specs import check_tensors, spec_of

if TYPE_CHECKING:
    from edgellm.artifact.config import ArtifactConfig


class NativeModel:
    """Token ids in, float32 logits out, on the native decoder: whole prefill chunks and single decode steps."""

    # a prompt's logits and keys/values are the same bits however it is chunked (tests/kernels/test_native_prefill.py),
    # so exact prefix reuse need not keep a fresh prefill's chunk boundaries (session/prompt_cache.py)
    chunk_invariant = True

    def __init__(self, config: ArtifactConfig, weights: Mapping[str, Any], threads: int, window: int, *,
                 prefill: str | None = None, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        """RoPE tables cover `window` positions, the most this model's caches will hold (Gemma's two tables of
        head dim 256 take 16 MiB at 4096). `prefill`: "native" (the library's native prefill: every SIMD variant
        has one, native.prefill_matmul()) or "token by token" (prompts through the decode step, for the scalar
        variant); models/protocol.py's `choose` says which (None: native where the library has it). `max_batch`: the most
        rows a decode_batch call takes."""
        prefill = prefill or ("native" if native.prefill_matmul() else "token by token")
        if prefill not in ("native", "token by token"):
            raise ValueError(f"prefill {prefill!r}: native or token by token")
        check_tensors(config, {name: spec_of(t) for name, t in weights.items()}, where="native model")  # before C
        cfg = self.config = config.model
        rope = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, window, cfg.max_position_embeddings)
        local = (rope_tables(cfg.head_dim, cfg.rope_local_theta, None, window, cfg.max_position_embeddings)
                 if cfg.rope_local_theta is not None else None)
        self.description = NativeDescription(config, family_of(cfg.architecture), weights, rope, local)
        self.native = native_decoder(self.description, threads, max_batch=max_batch)
        self.rope_length = rope.cos.shape[0]
        self.prefill = prefill

    def new_cache(self, max_length: int, *, kind: str = "f32", block: int = DEFAULT_BLOCK) -> ArrayKVCache:
        cfg = self.config
        return ArrayKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_length, kind=kind,
                            block=block)

    def run(self, ids: Sequence[int], start: int, cache: KVSpace, *, all_logits: bool = False) -> np.ndarray:
        """`ids` at positions start.. → logits (T, V) with `all_logits`, else the last position's (V,); their keys
        and values are written into `cache`."""
        end = start + len(ids)
        if end > min(cache.max_length, self.rope_length):
            raise ValueError(f"positions {start}..{end} exceed the context window {cache.max_length}")
        cache.reserve(end)  # the cache grows in blocks: room for these positions before its pointers are read
        if len(ids) > 1 and self.prefill == "native":
            logits = self.native.prefill(ids, start, cache, all_logits=all_logits)
            if logits is None:  # choose() checked the library first: a library that changed since, or a bad cache
                raise RuntimeError("the native library refused to prefill (no native prefill in this library, "
                                   "or a cache it cannot write)")
            return logits
        rows = []
        for i, token in enumerate(ids):  # a single token, or a prompt token by token through the decode step
            step = self.native.step(int(token), start + i, cache)
            if all_logits:
                rows.append(step)
        return np.stack(rows) if all_logits else step

    def decode_batch(self, tokens: Sequence[int], positions: Sequence[int],
                     caches: Sequence[KVSpace]) -> np.ndarray:
        """Float32 logits (M, V): row i is tokens[i] at positions[i] in caches[i], all M rows in one batched native
        step (NativeDecoder.step_batch: each row's logits those of the decode step alone). Rows may share a cache at
        consecutive positions, in row order (speculative verification). ValueError, nothing written, for a position
        beyond a cache's window or any row step_batch refuses."""
        if len(positions) != len(tokens) or len(caches) != len(tokens):
            raise ValueError(f"batched decode: {len(tokens)} tokens, {len(positions)} positions, {len(caches)} caches")
        ends: dict[int, tuple[KVSpace, int]] = {}
        for p, cache in zip(positions, caches, strict=True):
            if not 0 <= p < min(cache.max_length, self.rope_length):
                raise ValueError(f"batched decode: position {p} outside the context window {cache.max_length}")
            ends[id(cache)] = (cache, max(ends.get(id(cache), (cache, 0))[1], int(p) + 1))
        for cache, end in ends.values():  # room for every row's position before the caches' pointers are read
            cache.reserve(end)
        return self.native.step_batch(tokens, positions, caches)

    def shift_cache(self, cache: KVSpace, end: int, keep: int, drop: int) -> bool:
        """Re-rotating keys in place is left to torch's path: False, so the session re-encodes (exact)."""
        return False

    def streamed_spans(self) -> list[tuple[int, int]]:
        return self.description.streamed_spans

    def describe(self) -> str:
        return self.native.describe()
