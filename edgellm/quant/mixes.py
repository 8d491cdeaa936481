"""Per-tensor K-quant mixes from float weights: which GGUF block format each weight gets, as llama.cpp's ``_M`` recipes
choose them (the same tensors get the same block types, so an artifact made from a Hugging Face folder has the bits
of the GGUF that llama.cpp's quantizer makes from it)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from edgellm.quant.layout import BLOCK_WEIGHTS, ROW_GROUP

# a 256-weight block type where K is not a multiple of 256: the 32-weight type llama.cpp falls back to
_FALLBACK = {"q4_k": "q5_0", "q6_k": "q8"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
MIXES = ("q4_k_m", "q6_k")


def _more_bits(layer: int, layers: int) -> bool:
    """The layers Q4_K_M gives Q6_K on attn_v / ffn_down: the first and last eighth, and every third in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _wanted(mix: str, prefix: str, layers: int, tied: bool, position: Mapping[int, int]) -> str:
    if mix == "q6_k":
        return "q6_k"
    if prefix == "lm_head" or (tied and prefix == "model.embed_tokens"):
        return "q6_k"  # the output matrix (or the embedding that serves as it)
    layer = _LAYER.match(prefix)
    if layer and prefix.endswith(("self_attn.v_proj", "mlp.down_proj")) and _more_bits(position.get(int(layer[1]), int(layer[1])), layers):
        return "q6_k"
    return "q4_k"


def mix_formats(mix: str, shapes: dict[str, tuple[int, int]], layers: int, tied: bool,
                position: Mapping[int, int] | None = None) -> dict[str, str]:
    """The format of each weight (HF prefix -> [N, K]) under ``mix``: the recipe's block type, its 32-weight fallback
    where K is not a multiple of 256, f16 where neither fits (K not a multiple of 32, or N not of 8).

    ``position`` (layer -> its rank) replaces a layer's index in the recipe's layer rule: llama-quantize ranks the
    layers in the order of the GGUF's tensors, which is not the layers' order in a file whose tensors are sorted by
    name (blk.10 before blk.2); by default each layer's rank is its index (what the recipe means)."""
    if mix not in MIXES:
        raise ValueError(f"unknown K-quant mix {mix!r}; known: {', '.join(MIXES)}")
    out = {}
    for prefix, (n, k) in shapes.items():
        fmt = _wanted(mix, prefix, layers, tied, position or {})
        if k % BLOCK_WEIGHTS[fmt]:
            fmt = _FALLBACK[fmt]
        if k % BLOCK_WEIGHTS[fmt] or n % ROW_GROUP:
            fmt = "f16"
        out[prefix] = fmt
    return out
