"""Build the implementation `choose` picked (models/protocol.py) over an artifact's weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgellm.models.protocol import NATIVE, TORCH, TORCH_PREFILL_NATIVE_DECODE, Choice, Model

if TYPE_CHECKING:
    import torch

    from edgellm.artifact.config import ArtifactConfig


def load_model(choice: Choice, config: ArtifactConfig, weights: dict[str, Any], *, threads: int, window: int,
               kv_dtype: torch.dtype | None = None) -> Model:
    """The model `choice` names over `weights` (numpy arrays for NATIVE, torch tensors otherwise), its RoPE tables
    and caches covering `window` positions, on `threads` threads; `kv_dtype`: torch's f32 KV storage type."""
    if choice.implementation == NATIVE:  # torch is never imported on this path
        from edgellm.models.native_model import NativeModel

        return NativeModel(config, weights, threads, window, prefill=choice.prefill)
    if choice.implementation not in (TORCH, TORCH_PREFILL_NATIVE_DECODE):
        raise ValueError(f"no model implementation {choice.implementation!r}")
    import torch

    from edgellm.models.transformer import Transformer

    torch.set_num_threads(threads)  # torch's prefill threads
    transformer = Transformer(config, weights, kv_dtype=kv_dtype or torch.float32).eval()
    if choice.implementation == TORCH:
        return transformer
    from edgellm.models.native_description import NativeDescription, native_decoder
    from edgellm.models.torch_native import TorchPrefillNativeDecode

    local = transformer.local_rope.arrays if transformer.local_rope is not None else None
    description = NativeDescription(config, transformer.family, weights, transformer.rope.arrays, local)
    return TorchPrefillNativeDecode(transformer, native_decoder(description, threads), description, threads)
