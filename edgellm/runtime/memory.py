"""Memory estimate before load (R4): resident weights + KV cache + working buffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgellm.artifact.config import ArtifactConfig
from edgellm.kernels import native
from edgellm.models.kv_space import KVSpace
from edgellm.families.registry import family_of
from edgellm.quant.layout import EL_FORMAT_CODES, storage_bytes

if TYPE_CHECKING:
    import torch

_MIB = 2**20
NATIVE_FORMATS = tuple(EL_FORMAT_CODES)  # what the native kernels multiply as stored
# What `tokenizers` keeps resident per vocabulary entry once a tokenizer.json is parsed (and the parser's
# temporaries returned): 282 B on SmolLM2 (49,152 entries), 283 on Qwen2.5 (151,936), 312 on Gemma 3 (262,144).
TOKENIZER_BYTES_PER_ENTRY = 300


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_cache_bytes: int
    working_bytes: int
    kv_kind: str = "f32"
    tokenizer_bytes: int = 0
    prompt_cache_bytes: int = 0  # the prompt cache's budget (session/prompt_cache.py; 0: off)
    sequences: int = 1  # KV caches counted in kv_cache_bytes: a server's batch slots (serve --parallel)
    draft_bytes: int = 0  # a draft model's weights, working buffers and KV caches (runtime/draft.py; 0: none)

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + self.working_bytes + self.tokenizer_bytes
                + self.prompt_cache_bytes + self.draft_bytes)

    def as_dict(self) -> dict[str, int | str]:
        """The byte counts by part, and the KV cache's kind (as the JSON outputs carry them)."""
        return {"weights": self.weights_bytes, "kv_cache": self.kv_cache_bytes, "working": self.working_bytes,
                "tokenizer": self.tokenizer_bytes, "prompt_cache": self.prompt_cache_bytes, "draft": self.draft_bytes,
                "total": self.total_bytes,
                "kv_cache_kind": self.kv_kind}

    def describe(self) -> str:
        caches = f" for {self.sequences} sequences" if self.sequences > 1 else ""
        return (f"{self.total_bytes / _MIB:.0f} MiB (weights {self.weights_bytes / _MIB:.0f} + KV cache "
                f"{self.kv_cache_bytes / _MIB:.0f} {self.kv_kind}{caches} at the full window, allocated as it fills + working buffers "
                f"{self.working_bytes / _MIB:.0f} + tokenizer {self.tokenizer_bytes / _MIB:.0f}"
                + (f" + prompt cache {self.prompt_cache_bytes / _MIB:.0f}" if self.prompt_cache_bytes else "")
                + (f" + draft model {self.draft_bytes / _MIB:.0f}" if self.draft_bytes else "") + ")")


def stored_weight_bytes(config: ArtifactConfig) -> int:
    """The embedding and matmul weights as stored: what the native library keeps resident, and a lower bound of
    what torch's kernels prepare (computed without importing torch, so ruling a candidate out costs nothing)."""
    m, formats = config.model, config.quantization.formats
    return sum(storage_bytes(formats[name], shape) for name, shape in family_of(m.architecture).matmul_shapes(m).items())


def _matmul_weight_bytes(config: ArtifactConfig) -> int:
    """Bytes the embedding and matmul weights keep resident: as stored where the native library multiplies them
    all (mapped, nothing repacked; a tied LM head reads the table itself), else what torch's kernels prepare."""
    m, formats = config.model, config.quantization.formats
    shapes = family_of(m.architecture).matmul_shapes(m)
    if all(formats[name] in NATIVE_FORMATS for name in shapes) and native.load_library() is not None:
        return stored_weight_bytes(config)
    from edgellm.quant.layers import resident_bytes

    weights = sum(resident_bytes(formats[name], shape, embedding=name == "model.embed_tokens")
                  for name, shape in shapes.items())
    if m.tie_word_embeddings:  # the tied table is held twice: rows to gather, and packed for the lm_head matmul
        weights += resident_bytes(formats["model.embed_tokens"], (m.vocab_size, m.hidden_size), matmul_only=True)
    return weights


def estimate_memory(config: ArtifactConfig, context_window: int | None = None,
                    kv_dtype: torch.dtype | None = None, kv_cache: str = "f32", sequences: int = 1) -> MemoryEstimate:
    """What loading this artifact at `context_window` will cost, computed from the config alone (`kv_dtype`: the
    float type of the f32 kind's storage, a torch dtype; float32 when None).

    The KV cache is counted full (the window's worth): it starts at one block and grows, so this is its peak;
    `sequences` such caches (a server decoding that many sequences at once, runtime/batching.py).
    """
    m = config.model
    window = context_window or config.context_window
    family = family_of(m.architecture)
    weights = _matmul_weight_bytes(config)
    weights += 4 * sum(family.vector_shapes(m).values())  # norms and biases stay float32
    kv = sequences * KVSpace.bytes_needed(m.num_hidden_layers, m.num_key_value_heads, m.head_dim, window, kv_dtype,
                                          kind=kv_cache)
    chunk = min(config.prefill_chunk_size, window)
    width = 4 * m.hidden_size + (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim \
        + 3 * m.intermediate_size
    scores = m.num_attention_heads * chunk * window  # attention probabilities of one prefill chunk
    working = 4 * (chunk * width + scores + 2 * m.vocab_size) + 2 * 4 * window * m.head_dim
    if kv_cache != "f32":  # attention reads one layer's keys and values as floats
        working += 2 * 4 * window * m.num_key_value_heads * m.head_dim
    return MemoryEstimate(weights, kv, working, kv_cache, TOKENIZER_BYTES_PER_ENTRY * m.vocab_size,
                          sequences=sequences)
