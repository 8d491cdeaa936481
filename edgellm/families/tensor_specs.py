"""What a model of a given config may read: every tensor's name, element type and shape, and the checks that an
artifact's tensors (and the config they are read with) are exactly that, before any pointer reaches native code.

The native decoder (kernels/decoder.py) hands norm weights and biases to C as bare pointers and C reads
``hidden_size`` (or ``head_dim``, or the attention width) floats from each: a shorter vector is a read past its
end. So every opened artifact's shard headers (artifact/reader.py: ``edgellm verify``, ``doctor``, the store) and
every mapping of its weights are checked against :func:`expected_tensors`, and so are the arrays NativeModel and
torch's Transformer (whose native decode step reads the same arrays) are handed.

Matmul and embedding weights take their parts, shapes and element types from the storage format's definition
(quant/layout.py: ``FORMAT_SUFFIXES``, ``expected_shapes``, ``PART_DTYPES``), so a new block format is checked
here once it is defined there; norms and biases are float32 vectors (quant/schemes.py ``NORM_AND_BIAS_FORMAT``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from edgellm.errors import ArtifactError, EdgeLLMError
from edgellm.families.registry import family_of
from edgellm.quant.layout import FORMAT_SUFFIXES, PART_DTYPES, expected_shapes, storage_bytes
from edgellm.quant.schemes import NORM_AND_BIAS_FORMAT

if TYPE_CHECKING:
    from edgellm.families.config import ModelConfig


class _Formats(Protocol):
    @property
    def formats(self) -> Mapping[str, str]: ...


class StoredModel(Protocol):
    """What the checks read of an artifact's config (artifact.config.ArtifactConfig has it; the artifact layer
    imports this module, not back): the model's config and the storage format of each weight."""

    @property
    def model(self) -> ModelConfig: ...

    @property
    def quantization(self) -> _Formats: ...

MAX_DIM = 1 << 24  # the largest size of any one model dimension: products of two stay inside C's size_t math,
# and each one inside the int32 fields of the native description (el_model_desc)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the model reads: its element type (numpy's name: "float32", "uint8", ...) and shape."""

    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


class _Array(Protocol):
    """A numpy array or a torch tensor, as far as a spec reads it."""

    @property
    def dtype(self) -> object: ...

    @property
    def shape(self) -> Sequence[int]: ...


def check_model_config(cfg: ModelConfig) -> None:
    """ArtifactError unless the config's sizes and constants are ones every runtime can use: positive sizes up to
    MAX_DIM, query heads a multiple of the KV heads, an even head dim (RoPE rotates halves), positive finite
    constants where the model divides or scales by them, a sliding window of at least 1."""
    sizes: dict[str, object] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DIM:
            raise ArtifactError(f"model config: {name} is {value!r}, expected an integer in 1..{MAX_DIM}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ArtifactError(f"model config: num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {cfg.num_key_value_heads}")
    if cfg.head_dim % 2:
        raise ArtifactError(f"model config: head_dim {cfg.head_dim} is odd; RoPE needs an even head dim")
    if cfg.num_attention_heads * cfg.head_dim > MAX_DIM:
        raise ArtifactError(f"model config: attention width {cfg.num_attention_heads * cfg.head_dim} exceeds {MAX_DIM}")
    positive: dict[str, object] = {
        "rope_theta": cfg.rope_theta, "rope_local_theta": cfg.rope_local_theta,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar, "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "final_logit_softcapping": cfg.final_logit_softcapping}
    for name, value in positive.items():
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ArtifactError(f"model config: {name} is {value!r}, expected a positive finite number")
    if not (isinstance(cfg.rms_norm_eps, (int, float)) and math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps >= 0):
        raise ArtifactError(f"model config: rms_norm_eps is {cfg.rms_norm_eps!r}, expected a finite number >= 0")
    if cfg.sliding_window is not None and not (isinstance(cfg.sliding_window, int) and cfg.sliding_window >= 1):
        raise ArtifactError(f"model config: sliding_window is {cfg.sliding_window!r}, expected at least 1")


def expected_tensors(config: StoredModel) -> dict[str, TensorSpec]:
    """Every tensor an artifact of `config` holds, by name: the parts of each matmul/embedding weight in the
    format the config names for it, and the float32 norm weights and biases. ArtifactError where the config is
    unusable (check_model_config), or names a missing, unknown or misfitting format for a weight, or formats for
    weights the model does not have."""
    cfg = config.model
    check_model_config(cfg)
    family = family_of(cfg.architecture)
    formats = config.quantization.formats
    matmuls = family.matmul_shapes(cfg)
    unknown = sorted(set(formats) - set(matmuls))
    if unknown:
        raise ArtifactError(f"edgellm-config.json names a storage format for {unknown[0]!r}, which this "
                            f"{cfg.architecture} model does not have")
    specs: dict[str, TensorSpec] = {}
    for prefix, (n, k) in matmuls.items():
        fmt = formats.get(prefix)
        if fmt not in FORMAT_SUFFIXES:
            raise ArtifactError(f"edgellm-config.json: {prefix} has storage format {fmt!r}; known formats: "
                                f"{', '.join(FORMAT_SUFFIXES)}")
        try:
            storage_bytes(fmt, (n, k))  # the format's own constraints on the shape (whole blocks)
        except EdgeLLMError as exc:
            raise ArtifactError(f"edgellm-config.json: {prefix} [{n}, {k}] cannot be stored as {fmt}: {exc}") from None
        for part, shape in expected_shapes(fmt, n, k).items():
            specs[f"{prefix}.{part}"] = TensorSpec(PART_DTYPES[fmt][part], tuple(shape))
    vector = {"f32": "float32"}[NORM_AND_BIAS_FORMAT]
    for name, length in family.vector_shapes(cfg).items():
        specs[name] = TensorSpec(vector, (length,))
    return specs


def check_tensors(config: StoredModel, found: Mapping[str, TensorSpec], where: str = "artifact") -> None:
    """ArtifactError (one line: the tensor, what was expected and what was found) unless `found` holds exactly
    the tensors of expected_tensors(config), each of its element type and shape. `where` names the holder."""
    expected = expected_tensors(config)
    for name, spec in expected.items():
        got = found.get(name)
        if got is None:
            raise ArtifactError(f"{where}: tensor {name} is missing (expected {spec.describe()})")
        if got != spec:
            raise ArtifactError(f"{where}: tensor {name} is {got.describe()}, expected {spec.describe()}")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ArtifactError(f"{where}: tensor {extra[0]} is not one this {config.model.architecture} model reads "
                            f"({len(extra)} unexpected tensor{'s' * (len(extra) > 1)})")


def spec_of(array: _Array) -> TensorSpec:
    """The TensorSpec of a numpy array or a torch tensor (torch's dtype names without their "torch." prefix)."""
    return TensorSpec(str(array.dtype).removeprefix("torch."), tuple(int(d) for d in array.shape))
