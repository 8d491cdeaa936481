"""A scheme's description states its size per weight: it must be what the format's layout stores."""

from __future__ import annotations

import re

import pytest

from edgellm.quant.layout import storage_bytes
from edgellm.quant.schemes import SCHEMES

SIZE = re.compile(r"\(~?([\d.]+) (bits|bytes)/weight")


@pytest.mark.parametrize("name", [n for n, s in SCHEMES.items() if SIZE.search(s.description)])
def test_the_stated_size_per_weight_is_the_layout_s(name: str) -> None:
    scheme = SCHEMES[name]
    found = SIZE.search(scheme.description)
    assert found is not None
    value, unit = found.groups()
    stated_bits = float(value) * (8 if unit == "bytes" else 1)
    n, k = 64, 1024  # whole blocks of every format
    assert stated_bits == storage_bytes(scheme.linear, (n, k)) * 8 / (n * k), scheme.description
