"""What the runtime calls a model (`Model`), and the one place that decides which implementation runs an
artifact (`choose`).

Three implementations: NativeModel (models/native_model.py: the native library alone, no torch in the process),
torch's Transformer (models/transformer.py), and TorchPrefillNativeDecode (models/torch_native.py: torch's prefill,
the native decode step). `choose` picks one from the artifact's config, the runtime asked for and the kernel
library this process loaded, and says why; models/load.py builds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from edgellm.errors import EdgeLLMError
from edgellm.kernels import native
from edgellm.models.kv_space import DEFAULT_BLOCK, KVSpace
from edgellm.models.native_description import native_unsupported

if TYPE_CHECKING:
    from edgellm.artifact.config import ArtifactConfig

RUNTIMES = (None, "native", "torch")  # what runs a model: the native model where it can (None), or the one named
NATIVE, TORCH, TORCH_PREFILL_NATIVE_DECODE = "native", "torch", "torch prefill + native decode"


class SessionModel(Protocol):
    """What a generation session calls of a model (session/generation_session.py): token ids in, float32 numpy logits
    out, keys and values kept in a cache."""

    # a prompt's logits and keys/values are the same bits however it is chunked: exact prefix reuse need not keep a
    # fresh prefill's chunk boundaries (session/prompt_cache.py)
    chunk_invariant: bool

    def run(self, ids: Sequence[int], start: int, cache: KVSpace, *, all_logits: bool = False) -> np.ndarray:
        """`ids` at positions start.. → logits (T, V) with `all_logits`, else the last position's (V,); their keys
        and values are written into `cache`."""
        ...

    def shift_cache(self, cache: KVSpace, end: int, keep: int, drop: int) -> bool:
        """Move positions keep+drop..end-1 down to keep.. with their keys re-rotated, where the model can do it
        exactly (True); False leaves the cache as it was (the session re-encodes instead)."""
        ...

    def decode_batch(self, tokens: Sequence[int], positions: Sequence[int], caches: Sequence[KVSpace]) -> np.ndarray:
        """Float32 logits [M, vocab]: row i is token i at position i in cache i (rows may share a cache at
        consecutive positions; each sees the cache up to its own position)."""
        ...


class Model(SessionModel, Protocol):
    """A model the engine loaded: a session's calls, and the caches, weights and description it owns."""

    def new_cache(self, max_length: int, *, kind: str = "f32", block: int = DEFAULT_BLOCK) -> KVSpace:
        """An empty KV cache of up to `max_length` positions of KV kind `kind`, grown in multiples of `block`."""
        ...

    def streamed_spans(self) -> list[tuple[int, int]]:
        """(address, bytes) of the weights each decode step reads whole, worth moving into huge pages (none
        where torch decodes)."""
        ...

    def describe(self) -> str:
        """How this model decodes, in words (the engine's decode_path)."""
        ...


def decode_batch_by_run(model: SessionModel, tokens: Sequence[int], positions: Sequence[int],
                        caches: Sequence[KVSpace]) -> np.ndarray:
    """`Model.decode_batch` for a model without a batched step: each row through `run`, in order."""
    if not len(tokens) == len(positions) == len(caches):
        raise ValueError(f"decode_batch: {len(tokens)} tokens, {len(positions)} positions, {len(caches)} caches")
    if not tokens:
        raise ValueError("decode_batch: no rows")
    return np.stack([model.run([token], pos, cache)
                     for token, pos, cache in zip(tokens, positions, caches, strict=True)])


@dataclass(frozen=True)
class KernelState:
    """What the loaded kernel library offers: its variant ("torch" when none), why it was chosen, and the matmul
    its native prefill uses ("bf16", "f32", or None where it has none: the scalar variant)."""

    variant: str
    why: str
    prefill_matmul: str | None

    @classmethod
    def current(cls) -> KernelState:
        variant, why = native.active_kernel()
        return cls(variant, why, native.prefill_matmul() if variant != native.TORCH else None)


@dataclass(frozen=True)
class Choice:
    """Which implementation runs an artifact (NATIVE, TORCH or TORCH_PREFILL_NATIVE_DECODE) and why; for NATIVE,
    how prompts go in ("native" prefill, or "token by token" through the decode step); `decode`: how single-token
    steps run, in words ("native <variant>" or "torch (why)")."""

    implementation: str
    reason: str
    decode: str
    prefill: str = "native"


def choose(config: ArtifactConfig, runtime: str | None = None, kv_dtype: object = None, *,
           kernel: KernelState | None = None) -> Choice:
    """The implementation that runs `config`'s artifact when `runtime` (RUNTIMES) is asked for, with `kv_dtype` the
    float type of torch's f32 KV storage (None: float32), on `kernel` (the library this process loaded when None).
    EdgeLLMError for an unknown runtime, or for "native" where the native library cannot run the model."""
    if runtime not in RUNTIMES:
        raise EdgeLLMError(f"runtime {runtime!r}: choose one of {', '.join(r for r in RUNTIMES if r)}")
    kernel = kernel or KernelState.current()
    no_native_decode = native_unsupported(config, kv_dtype) or (kernel.why if kernel.variant == native.TORCH
                                                                  else None)
    if no_native_decode is not None:
        if runtime == "native":
            raise EdgeLLMError(f"this model cannot run on the native library alone: {no_native_decode}")
        return Choice(TORCH, "asked for" if runtime == "torch" else no_native_decode, f"torch ({no_native_decode})")
    decode = f"native {kernel.variant}"
    if runtime == "torch":
        return Choice(TORCH_PREFILL_NATIVE_DECODE, "asked for", decode)
    if kernel.prefill_matmul is not None:
        return Choice(NATIVE, f"native prefill ({kernel.prefill_matmul} GEMM) and decode", decode)
    if runtime == "native":
        return Choice(NATIVE, "asked for; no native prefill in this kernel library (the scalar variant): prompts go "
                      "token by token through the decode step", decode, prefill="token by token")
    return Choice(TORCH_PREFILL_NATIVE_DECODE, "no native prefill in this kernel library (the scalar variant; "
                  "runtime native prefills token by token)", decode)

