"""The artifact's self-description: `edgellm-config.json`, versioned, read into frozen dataclasses."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgellm.errors import ArtifactError
from edgellm.families.config import ModelConfig
from edgellm.families.registry import family_of
from edgellm.families.tensor_specs import expected_tensors

CONFIG_FILE = "edgellm-config.json"
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MANIFEST_FILE = "manifest.json"
# 2: q4 / q8 weights stored as the native kernels' blocks (q8 with a scale per 32); xxh3 digests.
# 3: q4 / q8 blocks of 8 rows interleaved (el_block_q4x8 / el_block_q8x8).
FORMAT_VERSION = 3


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
    kv_cache: str = "f32"  # the KV cache kind the runtime uses unless told otherwise ("f16", "f32" or "q8")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, ensure_ascii=False) + "\n"

    def check(self) -> None:
        """Raise ArtifactError unless every field has its declared type and every size is positive (a config is
        read from a file: a string layer count or a zero head count must not reach the runtime)."""
        for part in (self.model, self.tokenizer, self.quantization, self.sampling, self.source, self):
            for f in dataclasses.fields(part):
                value = getattr(part, f.name)
                if _checkable(str(f.type)) and not _has_type(value, str(f.type)):
                    raise ArtifactError(f"{CONFIG_FILE}: {f.name} is {value!r}, expected {f.type}")
        m = self.model
        sizes = {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
                 "num_hidden_layers": m.num_hidden_layers, "num_attention_heads": m.num_attention_heads,
                 "num_key_value_heads": m.num_key_value_heads, "head_dim": m.head_dim,
                 "context_window": self.context_window, "prefill_chunk_size": self.prefill_chunk_size,
                 "group_size": self.quantization.group_size}
        for name, value in sizes.items():
            if value < 1:
                raise ArtifactError(f"{CONFIG_FILE}: {name} must be at least 1, got {value}")
        if self.context_window > m.max_position_embeddings:
            raise ArtifactError(f"{CONFIG_FILE}: context_window {self.context_window} exceeds the model's maximum "
                                f"{m.max_position_embeddings}")
        expected_tensors(self)  # sizes every runtime can use, and a known format that fits each weight
        t = self.tokenizer
        for token in (t.bos_token_id, t.eos_token_id, t.pad_token_id, *t.stop_token_ids):
            if token is not None and not 0 <= token < m.vocab_size:
                raise ArtifactError(f"{CONFIG_FILE}: token id {token} is outside the vocabulary (0..{m.vocab_size - 1})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ArtifactConfig:
        version = check_format_version(raw.get("format_version"), Path(CONFIG_FILE))
        try:
            tok = dict(raw["tokenizer"])
            tok["stop_token_ids"] = tuple(tok["stop_token_ids"])
            family_of(raw["model"]["architecture"])
            config = cls(
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
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            raise ArtifactError(f"{CONFIG_FILE} is malformed: {exc}") from None
        config.check()
        return config

    @classmethod
    def read(cls, folder: Path) -> ArtifactConfig:
        return cls.from_dict(read_json(folder / CONFIG_FILE, f"{folder} is not an edgellm artifact: {CONFIG_FILE} is missing"))


_SCALARS: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "bool": bool, "str": str}


def _checkable(annotation: str) -> bool:
    """Annotations `_has_type` understands (nested dataclasses are checked field by field instead)."""
    return all(a.strip() in _SCALARS or a.strip() == "None" or a.strip().startswith(("tuple[", "dict["))
               for a in annotation.split("|"))


def _has_type(value: Any, annotation: str) -> bool:
    """Whether `value` fits a field annotation of this module (scalars, `X | None`, tuples, str-keyed dicts)."""
    options = [a.strip() for a in annotation.split("|")]
    if value is None:
        return "None" in options
    for option in options:
        if option in _SCALARS:
            if isinstance(value, _SCALARS[option]) and (option == "bool" or not isinstance(value, bool)):
                return True
        elif option.startswith("tuple[") and isinstance(value, tuple):
            inner = option[6:].split(",")[0].strip()
            return all(_has_type(v, inner) for v in value)
        elif option.startswith("dict[") and isinstance(value, dict):
            inner = option[5:-1].split(",", 1)[1].strip()  # the value type: str, or Any for free-form tables
            return all(isinstance(k, str) and (inner == "Any" or isinstance(v, str)) for k, v in value.items())
    return False
def check_format_version(version: object, path: Path) -> int:
    """``version`` when it is FORMAT_VERSION, else ArtifactError (one line, saying what to do)."""
    if version == FORMAT_VERSION:
        return FORMAT_VERSION
    if isinstance(version, int) and 0 < version < FORMAT_VERSION:
        raise ArtifactError(
            f"{path} is an artifact of format {version} from an older edgellm; this edgellm reads format "
            f"{FORMAT_VERSION}: re-run `edgellm convert` to rebuild it"
        )
    raise ArtifactError(f"{path} has format_version {version!r}; this edgellm reads version {FORMAT_VERSION}")


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
