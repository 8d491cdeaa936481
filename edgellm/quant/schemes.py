"""Quantization schemes: which weight format each kind of weight is stored in.

Names follow MLC LLM: the digit after ``q`` is the weight bit width (``0`` = not quantized), the
``f``-suffix is the precision of stored scales / float weights, ``_1`` is the layout revision.
Every field of a :class:`Scheme` is a format name from :mod:`edgellm.quant.formats`.
Norm weights and biases are never quantized: they always stay float32 (``NORM_AND_BIAS_FORMAT``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from edgellm.errors import UnsupportedQuantizationError

Role = Literal["linear", "embedding", "lm_head"]

NORM_AND_BIAS_FORMAT = "f32"
DEFAULT_SCHEME = "q4f16_1"
SOURCE_SCHEME = "source"  # every weight as the source stores it (a GGUF's own blocks): the default for GGUF sources


@dataclass(frozen=True)
class Scheme:
    """A named choice of weight format per role (transformer-block linears, embedding, lm_head).

    ``keeps_source``: the formats are not the scheme's but the source's, tensor by tensor (convert.pipeline's
    weight_formats asks the source which block format holds each one exactly); the role fields are then unused.
    ``mix``: the formats are a per-tensor K-quant recipe's (:mod:`edgellm.quant.mixes`); the role fields are unused."""

    name: str
    description: str
    linear: str
    embedding: str
    lm_head: str
    keeps_source: bool = False
    mix: str | None = None

    def format_for(self, role: Role) -> str:
        """The format for ``role``: ``"linear"``, ``"embedding"`` or ``"lm_head"``."""
        if role not in ("linear", "embedding", "lm_head"):
            raise ValueError(f"unknown weight role {role!r}; expected linear, embedding or lm_head")
        return getattr(self, role)


def _uniform(name: str, fmt: str, description: str) -> Scheme:
    return Scheme(name, description, linear=fmt, embedding=fmt, lm_head=fmt)


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        _uniform("q0f32", "f32", "no quantization: float32 weights (reference quality, 4 bytes/weight)"),
        _uniform("q0f16", "f16", "no quantization: float16 weights (2 bytes/weight on disk)"),
        _uniform("q8f16_1", "q8",
                 "int8 weights, symmetric, in groups of 32 along the input dim, one f16 scale per group (8.5 bits/weight)"),
        _uniform(
            "q4f16_1",
            "q4",
            "4-bit weights in groups of 32 along the input dim, f16 scale and min per group (5 bits/weight)",
        ),
        Scheme(
            SOURCE_SCHEME,
            "each weight in the source's own blocks, held exactly (GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K..Q6_K, F16, F32)",
            linear="f32", embedding="f32", lm_head="f32", keeps_source=True,
        ),
        Scheme(
            "q4_k_m",
            "llama.cpp's Q4_K_M recipe from float weights: Q4_K; Q6_K for the output matrix and the first, last and "
            "every third attn_v / ffn_down; Q5_0 / q8 where K is not a multiple of 256 (~4.9 bits/weight)",
            linear="f32", embedding="f32", lm_head="f32", mix="q4_k_m",
        ),
        Scheme(
            "q6_k",
            "GGUF Q6_K blocks for every weight (q8 where K is not a multiple of 256; 6.5625 bits/weight)",
            linear="f32", embedding="f32", lm_head="f32", mix="q6_k",
        ),
        Scheme(
            "q4f16_1e8",
            "q4 transformer-block linears; embedding and lm_head kept at q8 for quality",
            linear="q4",
            embedding="q8",
            lm_head="q8",
        ),
    )
}


def get_scheme(name: str) -> Scheme:
    """The scheme called ``name``; raises UnsupportedQuantizationError naming the known ones."""
    try:
        return SCHEMES[name]
    except KeyError:
        known = ", ".join(SCHEMES)
        raise UnsupportedQuantizationError(
            f"unknown quantization scheme {name!r}; known schemes: {known}"
        ) from None
