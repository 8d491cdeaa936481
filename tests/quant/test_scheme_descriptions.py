"""A scheme's description states its size per weight: it must be what the format's layout stores."""

from __future__ import annotations

import re

import pytest

from edgellm.quant.layout import storage_bytes
from edgellm.quant.mixes import mix_formats
from edgellm.quant.schemes import SCHEMES

SIZE = re.compile(r"\(~?([\d.]+) (bits|bytes)/weight")


@pytest.mark.parametrize("name", [n for n, s in SCHEMES.items() if SIZE.search(s.description)])
def test_the_stated_size_per_weight_is_the_layout_s(name: str) -> None:
    scheme = SCHEMES[name]
    found = SIZE.search(scheme.description)
    assert found is not None
    value, unit = found.groups()
    stated_bits = float(value) * (8 if unit == "bytes" else 1)
    if scheme.mix is None:
        n, k = 64, 1024  # whole blocks of every format
        assert stated_bits == storage_bytes(scheme.linear, (n, k)) * 8 / (n * k), scheme.description
        return
    # a mix: its bits over a Llama-2-7B-shaped model (every K a multiple of 256, as the stated figure assumes)
    shapes = {"model.embed_tokens": (32000, 4096), "lm_head": (32000, 4096)}
    for i in range(32):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.self_attn.{x}_proj": (4096, 4096) for x in "qkvo"}
        shapes |= {f"{p}.mlp.gate_proj": (11008, 4096), f"{p}.mlp.up_proj": (11008, 4096),
                   f"{p}.mlp.down_proj": (4096, 11008)}
    formats = mix_formats(scheme.mix, shapes, 32, False)
    bits = 8 * sum(storage_bytes(formats[name], shape) for name, shape in shapes.items()) / sum(
        n * k for n, k in shapes.values())
    assert abs(stated_bits - bits) <= 0.3, (scheme.description, bits)
