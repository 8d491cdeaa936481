"""Every architecture family edgellm runs, by the names its sources use."""

from __future__ import annotations

from edgellm.errors import ArtifactError, UnsupportedModelError
from edgellm.families.config import ModelConfig
from edgellm.families.family import Family
from edgellm.families.gemma2 import Gemma2
from edgellm.families.gemma3 import Gemma3
from edgellm.families.llama import Llama
from edgellm.families.phi3 import Phi3
from edgellm.families.qwen2 import Qwen2
from edgellm.families.qwen3 import Qwen3

FAMILIES: dict[str, Family] = {f.name: f for f in (Llama(), Qwen2(), Qwen3(), Gemma2(), Gemma3(), Phi3())}


def family_of(architecture: str) -> Family:
    """The family an artifact's `architecture` names."""
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ArtifactError(f"unknown architecture {architecture!r}; known: {', '.join(FAMILIES)}") from None


def family_for_hf(architectures: list[str]) -> Family:
    """The family of a Hugging Face config.json's `architectures` list."""
    for f in FAMILIES.values():
        if any(a in f.hf_architectures for a in architectures):
            return f
    supported = ", ".join(a for f in FAMILIES.values() for a in f.hf_architectures)
    raise UnsupportedModelError(f"architecture {', '.join(architectures) or 'unknown'} is not supported; "
                                f"supported: {supported}")


def family_for_gguf(architecture: object) -> Family:
    """The family of a GGUF file's `general.architecture` (whatever the file holds there; None when absent)."""
    for f in FAMILIES.values():
        if f.gguf_architecture == architecture:
            return f
    supported = ", ".join(f.gguf_architecture for f in FAMILIES.values())
    raise UnsupportedModelError(f"GGUF architecture {architecture!r} is not supported; supported: {supported}")


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every quantizable weight of this config, by Hugging Face prefix."""
    return family_of(cfg.architecture).matmul_shapes(cfg)
