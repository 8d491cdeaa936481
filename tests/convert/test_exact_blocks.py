"""GGUF tensors whose values edgellm's block formats hold exactly are stored block for block.

A GGUF Q4_1 tensor *is* q4 (el_block_q4 has Q4_1's layout), Q8_0 is q8, Q4_0 is q4 (m = -8 d) and
q8, Q5_0 is q5_0 (its own blocks) and q8. Converting such a tensor keeps its values bit for bit (checked value by
value against the dequantized source before it is used), so a catalog model compiled from a GGUF loses
nothing the GGUF did not already lose. The source scheme keeps every tensor in its own blocks; a q8 scheme
stores 8 bits as named, also for a 4-bit source tensor (no silent relabel).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from edgellm.convert.gguf_exact import EXACT_FORMATS
from edgellm.convert.gguf_source import _blocks
from edgellm.convert.pipeline import _quantize, open_source, weight_formats
from edgellm.quant.formats import dequantize, interleave, quantize


@pytest.mark.parametrize(("qtype", "fmt"), [(t, f) for t, fmts in EXACT_FORMATS.items() for f in fmts
                                             if t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0)])  # gguf-py quantizes these
def test_gguf_block_types_convert_exactly(qtype: T, fmt: str) -> None:
    w = np.random.default_rng(int(qtype)).standard_normal((8, 96)).astype(np.float32)
    w[0] = 0.0  # a zero row: d = 0
    raw = gguf_quantize(w, qtype)
    values = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
    blocks = _blocks(torch.from_numpy(raw), qtype, fmt, values)
    assert torch.equal(dequantize({"qweight": interleave(blocks, fmt)}, fmt), values)


def test_smollm2_q4_1_tensors_are_kept_block_for_block(smollm2_gguf: Path) -> None:
    source = open_source(smollm2_gguf)
    formats = weight_formats(source.config, "source", exact_formats=source.exact_formats)
    assert Counter(formats.values()) == {"q4": 210, "q8": 1}  # the source scheme: Q4_1 linears stay exact q4
    widened = weight_formats(source.config, "q8f16_1", exact_formats=source.exact_formats)
    assert Counter(widened.values()) == {"q8": 211}  # q8f16_1 is 8-bit as named, never q4 bits labelled q8
    for name in ("model.layers.2.self_attn.q_proj.weight", "model.layers.2.mlp.up_proj.weight"):
        w = source.load_tensor(name)  # q_proj: llama.cpp's row permutation undone on the blocks too
        parts = _quantize(source, name, w, "q4")
        assert torch.equal(dequantize(parts, "q4"), w)
        assert not torch.equal(dequantize(quantize(w, "q8"), "q8"), w)  # what q8 would have lost
    emb = source.load_tensor("model.embed_tokens.weight")
    assert torch.equal(dequantize(_quantize(source, "model.embed_tokens.weight", emb, "q8"), "q8"), emb)
    lossy = _quantize(source, "model.embed_tokens.weight", emb, "q4")  # Q8_0 is not exact in q4
    assert not torch.equal(dequantize(lossy, "q4"), emb)
