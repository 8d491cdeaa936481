"""The artifact's self-description: `edgellm-config.json`, versioned, read into frozen dataclasses."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgellm.errors import ArtifactError
from edgellm.models.config import ModelConfig
from edgellm.models.registry import family_of

CONFIG_FILE = "edgellm-config.json"
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


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
            family_of(raw["model"]["architecture"])
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
