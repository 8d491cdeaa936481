"""A model run by the native library alone: prefill chunks and decode steps through one NativeDecoder
(kernels/decoder.py), its KV cache in numpy arrays (models/kv_arrays.py), and no torch in the process (whose
import alone is 218 MiB of resident memory — more than llama.cpp's whole process on SmolLM2-135M).

The engine (runtime/engine.py) takes this path when the artifact decodes natively and the library can prefill
(every SIMD variant: the AVX512-BF16 GEMM where the CPU has it, else the float32 one), or, asked for it (runtime
"native"), where it cannot (the scalar variant): prompts then go through the decode step token by token. Otherwise
torch's Transformer runs the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from edgellm.errors import EdgeLLMError
from edgellm.kernels import native
from edgellm.kernels.decoder import NativeDecoder, decode_path
from edgellm.models.kv_arrays import ArrayKVCache
from edgellm.models.kv_space import DEFAULT_BLOCK
from edgellm.families.registry import family_of
from edgellm.models.rope_tables import rope_tables
from edgellm.families.tensor_specs import check_tensors, spec_of

if TYPE_CHECKING:
    from edgellm.artifact.config import ArtifactConfig

RUNTIMES = (None, "native", "torch")  # what runs a model: the native model where it can (None), or the one named

def native_model_unavailable(config: ArtifactConfig, kv_dtype: Any = None, *,
                             stepwise_prefill: bool = False) -> str | None:
    """Why this artifact cannot run on the native library alone (None when it can; every KV cache kind can).
    Where the library has no native prefill (native.prefill_matmul() is None: the scalar variant) it can only with
    `stepwise_prefill`: prompts then go through the decode step token by token (no torch, half the memory, but
    prefill at decode speed and with its 8-bit activations), which `Engine(runtime="native")` asks for. Every SIMD
    variant prefills natively: with the AVX512-BF16 GEMM where the CPU has it, else with the float32 one."""
    path = decode_path(config, kv_dtype)
    if not path.startswith("native"):
        return path.removeprefix("torch (").removesuffix(")")
    if not (native.prefill_matmul() or stepwise_prefill):
        return ("no native prefill in this kernel library (the scalar variant; runtime native prefills token by "
                "token)")
    return None


def torch_reason(config: ArtifactConfig, runtime: str | None = None, kv_dtype: Any = None) -> str | None:
    """Why torch's Transformer runs this artifact when `runtime` (RUNTIMES) is asked for; None: the native model
    runs it (for "native", token by token where it cannot prefill natively)."""
    if runtime not in RUNTIMES:
        raise EdgeLLMError(f"runtime {runtime!r}: choose one of {', '.join(r for r in RUNTIMES if r)}")
    if runtime == "torch":
        return "asked for"
    return native_model_unavailable(config, kv_dtype, stepwise_prefill=runtime == "native")


class NativeModel:
    """Token ids in, float32 logits out, on the native decoder: whole prefill chunks and single decode steps."""

    def __init__(self, config: ArtifactConfig, weights: Mapping[str, Any], threads: int, window: int) -> None:
        """RoPE tables cover `window` positions, the most this model's caches will hold (Gemma's two tables of
        head dim 256 take 16 MiB at 4096). Prompts go through the native prefill where the library has one (every
        SIMD variant: native.prefill_matmul()), else through the decode step, token by token (`prefill`: "native"
        or "token by token")."""
        check_tensors(config, {name: spec_of(t) for name, t in weights.items()}, where="native model")  # before C
        cfg = self.config = config.model
        rope = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, window, cfg.max_position_embeddings)
        local = (rope_tables(cfg.head_dim, cfg.rope_local_theta, None, window, cfg.max_position_embeddings)
                 if cfg.rope_local_theta is not None else None)
        self.native = NativeDecoder(native.load_library(), config, family_of(cfg.architecture), weights,
                                    native.pool(threads), rope, local)
        self.rope_length = rope.cos.shape[0]
        self.prefill = "native" if native.prefill_matmul() else "token by token"
        # a prompt's logits and keys/values are the same bits however it is chunked (tests/test_native_prefill.py),
        # so exact prefix reuse need not keep a fresh prefill's chunk boundaries (runtime/prompt_cache.py)
        self.chunk_invariant = True

    def new_cache(self, max_length: int, *, kind: str = "f32", block: int = DEFAULT_BLOCK) -> ArrayKVCache:
        cfg = self.config
        return ArrayKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_length, kind=kind,
                            block=block)

    def run(self, ids: Sequence[int], start: int, cache: ArrayKVCache, *, all_logits: bool = False) -> np.ndarray:
        """`ids` at positions start.. → logits (T, V) with `all_logits`, else the last position's (V,); their keys
        and values are written into `cache`."""
        end = start + len(ids)
        if end > min(cache.max_length, self.rope_length):
            raise ValueError(f"positions {start}..{end} exceed the context window {cache.max_length}")
        cache.reserve(end)  # the cache grows in blocks: room for these positions before its pointers are read
        if len(ids) > 1 and self.prefill == "native":
            logits = self.native.prefill(ids, start, cache, all_logits=all_logits)
            if logits is None:  # the engine checked native_model_unavailable first: a library that changed since
                raise RuntimeError("the native library refused to prefill (no native prefill in this library, "
                                   "or a cache it cannot write)")
            return logits
        rows = []
        for i, token in enumerate(ids):  # a single token, or a prompt token by token through the decode step
            logits = self.native.step(int(token), start + i, cache)
            if all_logits:
                rows.append(logits)
        return np.stack(rows) if all_logits else logits

    def shift_cache(self, cache: ArrayKVCache, end: int, keep: int, drop: int) -> bool:
        """Re-rotating keys in place is left to torch's path: False, so the session re-encodes (exact)."""
        return False
