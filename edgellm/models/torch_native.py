"""A model whose prompts go through torch's Transformer and whose decode steps go through the native library
(a Model, models/protocol.py): what runs a natively decodable artifact when torch is asked for, or where the kernel
library has no native prefill (the scalar variant). Both halves read and write the same torch KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from edgellm.kernels.decoder import NativeDecoder
from edgellm.models.kv_space import DEFAULT_BLOCK, KVSpace
from edgellm.models.native_description import NativeDescription
from edgellm.models.protocol import decode_batch_by_run
from edgellm.models.transformer import Transformer


class TorchPrefillNativeDecode:
    """torch's prefill and the native decode step over one torch KV cache."""

    chunk_invariant = False  # torch's prefill: a prompt's bits depend on its chunks

    def __init__(self, transformer: Transformer, native: NativeDecoder | None, description: NativeDescription,
                 threads: int) -> None:
        """`native`: the decode step over `description` (None: torch decodes too, as where a test takes it
        away); `threads`: torch's threads for prefill."""
        self.torch = transformer
        self.native = native
        self.description = description
        self.threads = threads

    def new_cache(self, max_length: int, *, kind: str = "f32", block: int = DEFAULT_BLOCK) -> KVSpace:
        return self.torch.new_cache(max_length, kind=kind, block=block)

    def run(self, ids: Sequence[int], start: int, cache: KVSpace, *, all_logits: bool = False) -> np.ndarray:
        """One token whose cache the native step takes goes native, leaving torch one thread: its OpenMP workers,
        woken by torch ops between steps, would otherwise spin next to the step's own threads (docs/performance.md);
        everything else goes through torch on `threads`."""
        if len(ids) == 1 and self.native is not None:
            torch.set_num_threads(1)
            if self.native.accepts(cache):
                if start + 1 > min(cache.max_length, self.torch.rope.length):
                    raise ValueError(f"positions {start}..{start + 1} exceed the context window {cache.max_length}")
                cache.reserve(start + 1)  # the cache grows in blocks: room for this position before its pointer is read
                logits = self.native.step(int(ids[0]), start, cache)
                return logits[None] if all_logits else logits
        else:
            torch.set_num_threads(self.threads)
        return self.torch.run(ids, start, cache, all_logits=all_logits)

    def decode_batch(self, tokens: Sequence[int], positions: Sequence[int], caches: Sequence[KVSpace]) -> np.ndarray:
        return decode_batch_by_run(self, tokens, positions, caches)

    def shift_cache(self, cache: KVSpace, end: int, keep: int, drop: int) -> bool:
        return self.torch.shift_cache(cache, end, keep, drop)

    def streamed_spans(self) -> list[tuple[int, int]]:
        return self.description.streamed_spans if self.native is not None else []

    def describe(self) -> str:
        return self.native.describe() if self.native is not None else "torch"
