"""The artifact's self-description: `edgellm-config.json`, versioned, read into frozen dataclasses."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgellm.errors import ArtifactError

CONFIG_FILE = "edgellm-config.json"
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, named after Hugging Face's config keys."""

    architecture: str  # "llama" (Llama, SmolLM) or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)

    def matmul_weight_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) shape of every embedding/projection weight, by Hugging Face prefix."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        d, f = self.hidden_size, self.intermediate_size
        shapes = {"model.embed_tokens": (self.vocab_size, d)}
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (self.vocab_size, d)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            shapes |= {f"{p}.self_attn.q_proj": (q, d), f"{p}.self_attn.k_proj": (kv, d),
                       f"{p}.self_attn.v_proj": (kv, d), f"{p}.self_attn.o_proj": (d, q),
                       f"{p}.mlp.gate_proj": (f, d), f"{p}.mlp.up_proj": (f, d), f"{p}.mlp.down_proj": (d, f)}
        return shapes

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ArtifactError(f"unknown architecture {self.architecture!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ArtifactError("num_attention_heads must be a multiple of num_key_value_heads")


@dataclass(frozen=True)
class TokenizerConfig:
    """Special token ids; the vocabulary itself lives in tokenizer.json."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling used when a request does not say otherwise."""

    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256


@dataclass(frozen=True)
class QuantizationConfig:
    """The scheme name plus the storage format of every linear/embedding weight (per-tensor overrides)."""

    scheme: str
    group_size: int
    formats: dict[str, str]  # weight prefix, e.g. "model.layers.0.mlp.up_proj" -> "q4"

    def format_of(self, prefix: str) -> str:
        try:
            return self.formats[prefix]
        except KeyError:
            raise ArtifactError(f"{CONFIG_FILE} names no storage format for {prefix!r}") from None


@dataclass(frozen=True)
class SourceInfo:
    """Where the artifact came from (for provenance, never read by the runtime)."""

    kind: str  # "gguf" or "hf"
    name: str
    sha256: str | None = None


@dataclass(frozen=True)
class ArtifactConfig:
    """Everything the runtime needs besides the weights and the tokenizer."""

    model: ModelConfig
    tokenizer: TokenizerConfig
    quantization: QuantizationConfig
    context_window: int
    prefill_chunk_size: int
    sampling: SamplingDefaults
    source: SourceInfo
    sliding_window: int | None = None
    format_version: int = FORMAT_VERSION
    edgellm_version: str = field(default="")
    kv_cache: str = "f32"  # the KV cache kind the runtime uses unless told otherwise ("f32" or "q8")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ArtifactConfig:
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise ArtifactError(
                f"{CONFIG_FILE} has format_version {version!r}; this edgellm reads version {FORMAT_VERSION}"
            )
        try:
            tok = dict(raw["tokenizer"])
            tok["stop_token_ids"] = tuple(tok["stop_token_ids"])
            return cls(
                model=ModelConfig(**raw["model"]),
                tokenizer=TokenizerConfig(**tok),
                quantization=QuantizationConfig(**raw["quantization"]),
                context_window=int(raw["context_window"]),
                prefill_chunk_size=int(raw["prefill_chunk_size"]),
                sampling=SamplingDefaults(**raw["sampling"]),
                source=SourceInfo(**raw["source"]),
                sliding_window=raw.get("sliding_window"),
                format_version=version,
                edgellm_version=raw.get("edgellm_version", ""),
                kv_cache=str(raw.get("kv_cache", "f32")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{CONFIG_FILE} is malformed: {exc}") from None

    @classmethod
    def read(cls, folder: Path) -> ArtifactConfig:
        return cls.from_dict(read_json(folder / CONFIG_FILE, f"{folder} is not an edgellm artifact: {CONFIG_FILE} is missing"))


def read_json(path: Path, missing: str) -> dict[str, Any]:
    """A JSON object from an artifact file; `missing` is the error message when the file does not exist."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(missing) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ArtifactError(f"{path} must hold a JSON object")
    return raw
