"""The sizes and shapes of the stored weight formats (quant/formats.py has the layouts in full), without torch:
an inference process on the native kernels checks its mapped arrays with these alone."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from edgellm.errors import ArtifactError, UnsupportedQuantizationError

Q4_GROUP = 32  # weights per block, for q4 and q8 alike
BLOCK_BYTES = {"q4": 4 + Q4_GROUP // 2, "q8": 2 + Q4_GROUP}  # bytes of one row's block of 32
ROW_GROUP = 8  # rows interleaved per stored block (EL_ROWS)
FORMAT_SUFFIXES: dict[str, tuple[str, ...]] = {
    "f32": ("weight",),
    "f16": ("weight",),
    "q8": ("qweight",),
    "q4": ("qweight",),
}
FORMATS: tuple[str, ...] = tuple(FORMAT_SUFFIXES)
# each part's element type, as numpy and torch name it (torch's with a "torch." prefix)
PART_DTYPES: dict[str, dict[str, str]] = {
    "f32": {"weight": "float32"},
    "f16": {"weight": "float16"},
    "q8": {"qweight": "uint8"},
    "q4": {"qweight": "uint8"},
}
_ITEM_SIZES = {"float32": 4, "float16": 2, "uint8": 1}


def check_format(fmt: str) -> None:
    """Raise UnsupportedQuantizationError unless ``fmt`` is a known format."""
    if fmt not in FORMAT_SUFFIXES:
        raise UnsupportedQuantizationError(
            f"unknown weight format {fmt!r}; known formats: {', '.join(FORMATS)}"
        )


def expected_shapes(fmt: str, n: int, k: int) -> dict[str, tuple[int, ...]]:
    """The shape of each stored part of an ``[N, K]`` weight in format ``fmt``."""
    if fmt in ("f32", "f16"):
        return {"weight": (n, k)}
    return {"qweight": (n // ROW_GROUP, k // Q4_GROUP * BLOCK_BYTES[fmt] * ROW_GROUP)}


def weight_shape(fmt: str, parts: Mapping[str, Any]) -> tuple[int, int]:
    """The logical ``(N, K)`` of ``parts`` (torch tensors or numpy arrays); raises ArtifactError if parts are
    missing or malformed."""
    check_format(fmt)
    missing = [p for p in FORMAT_SUFFIXES[fmt] if p not in parts]
    if missing:
        raise ArtifactError(f"{fmt} weight is missing part(s) {', '.join(missing)} (has {', '.join(parts)})")
    main = parts["weight" if fmt in ("f32", "f16") else "qweight"]
    if len(main.shape) != 2:
        raise ArtifactError(f"{fmt} weight must be 2-D, got shape {tuple(main.shape)}")
    n, k = main.shape
    if fmt in BLOCK_BYTES:
        group_bytes = BLOCK_BYTES[fmt] * ROW_GROUP
        if k % group_bytes:
            raise ArtifactError(f"{fmt} weight groups are {k} bytes, not whole {group_bytes}-byte blocks")
        n, k = n * ROW_GROUP, k // group_bytes * Q4_GROUP
    for p, shape in expected_shapes(fmt, n, k).items():
        t, dtype = parts[p], PART_DTYPES[fmt][p]
        got = str(t.dtype).removeprefix("torch.")
        if got != dtype or tuple(t.shape) != shape:
            raise ArtifactError(
                f"{fmt} part {p!r} should be {dtype} {list(shape)}, got {got} {list(t.shape)}"
            )
    return n, k


def storage_bytes(fmt: str, shape: tuple[int, int]) -> int:
    """Exact bytes the parts of an ``[N, K]`` weight occupy in format ``fmt``."""
    check_format(fmt)
    n, k = shape
    if fmt in BLOCK_BYTES and (k % Q4_GROUP or n % ROW_GROUP):
        raise UnsupportedQuantizationError(
            f"{fmt} needs K to be a multiple of {Q4_GROUP} and N of {ROW_GROUP}, got [{n}, {k}]")
    return sum(math.prod(s) * _ITEM_SIZES[PART_DTYPES[fmt][p]] for p, s in expected_shapes(fmt, n, k).items())


def bits_per_weight(fmt: str, shape: tuple[int, int] | None = None) -> float:
    """Storage bits per weight: exact for ``shape``, else the large-K value.

    f32 32, f16 16, q4 4 + 2*16/32 = 5.0, q8 8 + 16/32 = 8.5 (any shape).
    """
    check_format(fmt)
    if shape is None:
        return {"f32": 32.0, "f16": 16.0, "q8": 8.5, "q4": 5.0}[fmt]
    return 8.0 * storage_bytes(fmt, shape) / (shape[0] * shape[1])
