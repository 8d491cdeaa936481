"""The sizes and shapes of the stored weight formats (quant/formats.py has the layouts in full), without torch:
an inference process on the native kernels checks its mapped arrays with these alone."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from edgellm.errors import ArtifactError, UnsupportedQuantizationError
from edgellm.kernels import abi

Q4_GROUP = 32  # weights per block, for q4 and q8 alike
QK_K = 256  # weights per K-quant super-block (q2_k .. q6_k)
# weights per block along K, and bytes of one row's block: q4 / q8 are edgellm's own (q4 = llama.cpp's Q4_1, q8 its
# Q8_0); the others are llama.cpp's blocks of the same name (q5_0 = Q5_0, ...), held exactly as a GGUF stores them
BLOCK_WEIGHTS = {"q4": Q4_GROUP, "q8": Q4_GROUP, "q4_0": Q4_GROUP, "iq4_nl": Q4_GROUP, "q5_0": Q4_GROUP, "q5_1": Q4_GROUP,
                 "q2_k": QK_K, "q3_k": QK_K, "q4_k": QK_K, "q5_k": QK_K, "q6_k": QK_K}
BLOCK_BYTES = {
    "q4": 4 + Q4_GROUP // 2,  # f16 d, f16 m, 16 nibble bytes
    "q8": 2 + Q4_GROUP,  # f16 d, 32 int8
    "q4_0": 2 + Q4_GROUP // 2,  # f16 d, 16 nibble bytes (q - 8)
    "iq4_nl": 2 + Q4_GROUP // 2,  # f16 d, 16 nibble bytes (indices into IQ4_NL's 16 values)
    "q5_0": 2 + 4 + Q4_GROUP // 2,  # f16 d, 32 high bits, 16 nibble bytes
    "q5_1": 2 + 2 + 4 + Q4_GROUP // 2,  # f16 d, f16 m, 32 high bits, 16 nibble bytes
    "q2_k": QK_K // 16 + QK_K // 4 + 2 + 2,  # 16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit q, f16 d, dmin
    "q3_k": QK_K // 8 + QK_K // 4 + 12 + 2,  # 32 high-bit bytes, 64 bytes of 2-bit q, 12 bytes of 6-bit scales, f16 d
    "q4_k": 2 + 2 + 12 + QK_K // 2,  # f16 d, f16 dmin, 12 bytes of 6-bit scales / mins, 128 nibble bytes
    "q5_k": 2 + 2 + 12 + QK_K // 8 + QK_K // 2,  # q4_k's fields with 32 high-bit bytes before the nibbles
    "q6_k": QK_K // 2 + QK_K // 4 + QK_K // 16 + 2,  # 128 low-nibble bytes, 64 high-bit bytes, 16 int8 scales, f16 d
}
# the native library's code of each block format (EL_Q4, ... in edgellm_kernels.h)
EL_FORMAT_CODES = {fmt: code for fmt, code in abi.FORMATS.items() if fmt != "f32"}
# GGUF's own block types: held from a GGUF exactly; q5_0, q4_k and q6_k are also made by quant/kquant.py
SOURCE_ONLY = ("q4_0", "iq4_nl", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
ROW_GROUP = 8  # rows interleaved per stored block (EL_ROWS)
FORMAT_SUFFIXES: dict[str, tuple[str, ...]] = {
    "f32": ("weight",),
    "f16": ("weight",),
    "q8": ("qweight",),
    "q4": ("qweight",),
    **{f: ("qweight",) for f in SOURCE_ONLY},
}
FORMATS: tuple[str, ...] = tuple(FORMAT_SUFFIXES)
# each part's element type, as numpy and torch name it (torch's with a "torch." prefix)
PART_DTYPES: dict[str, dict[str, str]] = {
    "f32": {"weight": "float32"},
    "f16": {"weight": "float16"},
    **{f: {"qweight": "uint8"} for f in BLOCK_BYTES},
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
    return {"qweight": (n // ROW_GROUP, k // BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt] * ROW_GROUP)}


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
        n, k = n * ROW_GROUP, k // group_bytes * BLOCK_WEIGHTS[fmt]
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
    if fmt in BLOCK_BYTES and (k % BLOCK_WEIGHTS[fmt] or n % ROW_GROUP):
        raise UnsupportedQuantizationError(
            f"{fmt} needs K to be a multiple of {BLOCK_WEIGHTS[fmt]} and N of {ROW_GROUP}, got [{n}, {k}]")
    return sum(math.prod(s) * _ITEM_SIZES[PART_DTYPES[fmt][p]] for p, s in expected_shapes(fmt, n, k).items())


def bits_per_weight(fmt: str, shape: tuple[int, int] | None = None) -> float:
    """Storage bits per weight: exact for ``shape``, else the large-K value.

    f32 32, f16 16, q4 4 + 2*16/32 = 5.0, q8 8 + 16/32 = 8.5, q4_0 and iq4_nl 4.5, q5_0 5.5, q5_1 6.0, q2_k 2.625, q3_k 3.4375,
    q4_k 4.5, q5_k 5.5, q6_k 6.5625 (any shape).
    """
    check_format(fmt)
    if shape is None:
        return {"f32": 32.0, "f16": 16.0}.get(fmt) or 8.0 * BLOCK_BYTES[fmt] / BLOCK_WEIGHTS[fmt]
    return 8.0 * storage_bytes(fmt, shape) / (shape[0] * shape[1])


def format_summary(formats: Mapping[str, str], shapes: Mapping[str, tuple[int, int]]) -> dict[str, dict[str, float]]:
    """Per format of the weights ``formats`` names (prefix -> format; ``shapes`` prefix -> [N, K]): how many tensors,
    their parameters and the bits per parameter they are stored in, the formats with the most parameters first."""
    out: dict[str, dict[str, float]] = {}
    for prefix, fmt in formats.items():
        n, k = shapes[prefix]
        row = out.setdefault(fmt, {"tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += n * k
        row["bytes"] += storage_bytes(fmt, (n, k))
    for row in out.values():
        row["bits_per_parameter"] = round(8.0 * row["bytes"] / row["parameters"], 4) if row["parameters"] else 0.0
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["parameters"]))
