"""Which storage format each weight of a model gets under a scheme, from the config alone (no torch: the memory
planner asks this of schemes it has not converted)."""

from __future__ import annotations

from collections.abc import Callable

from edgellm.errors import UnsupportedQuantizationError
from edgellm.families.config import ModelConfig
from edgellm.families.registry import weight_shapes
from edgellm.quant.layout import BLOCK_WEIGHTS, ROW_GROUP, SOURCE_ONLY, check_format
from edgellm.quant.mixes import mix_formats
from edgellm.quant.schemes import get_scheme

GROUP_SIZE = 32  # weights per q4/q8 block
_PRECISION = ("q4", "q8", "f16", "f32")  # low → high


def _source_formats(shapes: dict[str, tuple[int, int]], exact_formats: Callable[[str], tuple[str, ...]]
                    ) -> dict[str, str]:
    """The source scheme: each weight in the format that holds its source tensor exactly in the fewest bits (float32
    where a block format's shape rule, N a multiple of 8 and K of its block, rules the blocks out: still exact).
    Raises UnsupportedQuantizationError, in one line, for a tensor no edgellm format holds exactly."""
    formats = {}
    for prefix, (n, k) in shapes.items():
        exact = exact_formats(f"{prefix}.weight")
        if not exact:
            raise UnsupportedQuantizationError(
                f"the source scheme keeps each weight as the source stores it, and {prefix} is in a type edgellm "
                "cannot hold exactly (a GGUF holds it as Q4_0/Q4_1/IQ4_NL/Q5_0/Q5_1/Q8_0/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/F16/F32 otherwise); "
                "choose a scheme that re-quantizes it, e.g. -q q8f16_1")
        fmt = exact[0]
        if fmt in BLOCK_WEIGHTS and (k % BLOCK_WEIGHTS[fmt] or n % ROW_GROUP):
            fmt = "f32"
        formats[prefix] = fmt
    return formats


def weight_formats(cfg: ModelConfig, scheme_name: str, overrides: dict[str, str] | None = None,
                   exact_formats: Callable[[str], tuple[str, ...]] | None = None) -> dict[str, str]:
    """Storage format of every matmul/embedding weight, by Hugging Face prefix. `exact_formats(name)` lists the
    formats that hold a source tensor exactly, fewest bits first (the source scheme takes the first; a requested
    block format the source holds exactly is taken from the source's own blocks, others are quantized as named)."""
    scheme = get_scheme(scheme_name)
    shapes = weight_shapes(cfg)
    if scheme.keeps_source:
        if exact_formats is None:
            raise UnsupportedQuantizationError(
                f"the {scheme.name} scheme keeps a GGUF's own blocks; this source is not a GGUF file "
                "(choose e.g. -q q8f16_1 or q4f16_1)")
        formats = _source_formats(shapes, exact_formats)
    elif scheme.mix is not None:
        formats = mix_formats(scheme.mix, shapes, cfg.num_hidden_layers, cfg.tie_word_embeddings)
    else:
        formats = dict.fromkeys(shapes, scheme.linear)
        if cfg.tie_word_embeddings:  # one tensor serves both roles: keep the more precise of the two formats
            formats["model.embed_tokens"] = max(scheme.embedding, scheme.lm_head, key=_PRECISION.index)
        else:
            formats["model.embed_tokens"] = scheme.embedding
            formats["lm_head"] = scheme.lm_head
    for prefix, fmt in (overrides or {}).items():
        if prefix not in formats:
            raise UnsupportedQuantizationError(f"override names {prefix!r}, which is not a weight of this model")
        check_format(fmt)
        formats[prefix] = fmt
    for prefix, fmt in formats.items():  # q4/q8 blocks: the input dim a multiple of 32, the output dim of 8
        if fmt in ("q4", "q8") and (shapes[prefix][1] % GROUP_SIZE or shapes[prefix][0] % ROW_GROUP):
            formats[prefix] = "f16"
        elif fmt in SOURCE_ONLY and (shapes[prefix][1] % BLOCK_WEIGHTS[fmt] or shapes[prefix][0] % ROW_GROUP):
            raise UnsupportedQuantizationError(
                f"override gives {prefix} {fmt}, whose blocks need N a multiple of {ROW_GROUP} and K of "
                f"{BLOCK_WEIGHTS[fmt]}; {prefix} is {list(shapes[prefix])}")
    return formats
