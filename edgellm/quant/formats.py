"""Portable, safetensors-friendly weight formats: quantize, dequantize, sizes, row gathers.

A weight ``W[N, K]`` (N outputs, K inputs) is stored as one or more *parts*; in a safetensors file
part ``p`` of the weight at ``prefix`` is the tensor ``f"{prefix}.{p}"``. Quantized weights are
stored in the layout the native kernels read (``edgellm/kernels/csrc/edgellm_kernels.h``), so a
load maps them and copies nothing; the torch kernels repack at load (see
:mod:`edgellm.quant.dispatch`).

Quantized weights are blocks of 32 inputs, one *row block* per row (``el_block_q4`` 20 bytes,
``el_block_q8`` 34 bytes, as below), stored in groups of 8 rows with the quants of the 8 rows
interleaved 4 bytes at a time (``el_block_q4x8`` / ``el_block_q8x8``: the group's 8 scales, [8
mins,] then for each 4-byte column of the row blocks' quant bytes, that column of rows 0..7).
:func:`row_blocks` undoes the interleaving; :func:`q4_fields` / :func:`q8_fields` read row blocks.

=======  =====================================================================================
format   parts
=======  =====================================================================================
``f32``  ``weight`` float32 [N, K]
``f16``  ``weight`` float16 [N, K]
``q8``   ``qweight`` uint8 [N/8, K/32 * 272]: row blocks ``el_block_q8`` = f16 scale d, 32 int8
         q; W = d * q, q in -127..127 (group-wise, as llama.cpp's Q8_0), 8 rows interleaved
``q4``   ``qweight`` uint8 [N/8, K/32 * 160]: row blocks ``el_block_q4`` = f16 scale d, f16 min
         m, 16 bytes (byte j: element j in the low nibble, j + 16 in the high one; llama.cpp's
         Q4_1); W = d * q + m, q in 0..15, 8 rows interleaved
=======  =====================================================================================

The GGUF block formats (``q4_0``, ``iq4_nl``, ``q5_0``, ``q5_1``, ``q2_k``, ``q3_k``, ``q4_k``, ``q5_k``, ``q6_k``:
llama.cpp's Q4_0, IQ4_NL, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) have the same single ``qweight`` part: the GGUF's own row blocks, grouped by 8 rows as
``_SECTIONS`` lists (each field of the 8 rows stored together); their values are gguf-py's ``dequantize``, bit for
bit. edgellm has no quantizer for them: they are only ever read from a GGUF.

Block fields are little-endian. For q4 and q8, K must be a multiple of 32 and N of 8.

Rounding: q8 rounds its scale *up* to f16 (so ``|w| / scale <= 127``); q4 fits scale and min by
least squares per group, rounds them to f16, and q is then the round-to-nearest grid index under
the stored (f16) scale/min, so the per-weight error is the minimum possible for those stored
values, and at most ``scale / 2`` inside the fitted range.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

from edgellm.errors import ArtifactError, UnsupportedQuantizationError
from edgellm.quant.kquant import quantize_blocks
from edgellm.quant.layout import (  # noqa: F401 (the formats' sizes, re-exported where formats are used)
    BLOCK_BYTES, BLOCK_WEIGHTS, EL_FORMAT_CODES, FORMAT_SUFFIXES, FORMATS, Q4_GROUP, QK_K, ROW_GROUP, SOURCE_ONLY, bits_per_weight,
    check_format, storage_bytes, weight_shape)

Parts = dict[str, Tensor]

_LITTLE_ENDIAN = sys.byteorder == "little"
_ROWS_PER_CHUNK = 4096  # bounds quantize()'s temporaries for huge embeddings


def tensor_names(prefix: str, fmt: str) -> list[str]:
    """Safetensors names of the parts of the weight at ``prefix``, e.g. ``m.up_proj.qweight``."""
    check_format(fmt)
    return [f"{prefix}.{p}" for p in FORMAT_SUFFIXES[fmt]]


# ---------------------------------------------------------------------------- f16 directed rounding


def _f16_up(x: Tensor) -> Tensor:
    """Smallest float16 >= x (x float32)."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, math.inf)), h)


# ---------------------------------------------------------------------------- quantize


def _f16_bytes(h: Tensor) -> Tensor:
    """float16 [..., nb] -> uint8 [..., nb, 2], little-endian (the block header byte order)."""
    b = h.contiguous().view(torch.uint8).view(*h.shape, 2)
    return b if _LITTLE_ENDIAN else b.flip(-1)


def _f16_from(b: Tensor) -> Tensor:
    """uint8 [..., nb, 2] little-endian -> float16 [..., nb] (a small copy)."""
    b = b if _LITTLE_ENDIAN else b.flip(-1)
    return b.contiguous().view(torch.float16).squeeze(-1)


def q8_fields(qweight: Tensor) -> tuple[Tensor, Tensor]:
    """q8 block rows [..., nb * 34] -> (scales float16 [..., nb], q int8 [..., nb, 32])."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["q8"])
    return _f16_from(blk[..., :2]), blk[..., 2:].view(torch.int8)


def q4_fields(qweight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q4 block rows [..., nb * 20] -> (scales f16 [..., nb], mins f16 [..., nb], q uint8 [..., nb, 32])."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["q4"])
    qs = blk[..., 4:]
    return _f16_from(blk[..., 0:2]), _f16_from(blk[..., 2:4]), torch.cat((qs & 15, qs >> 4), dim=-1)


# How a group of 8 row blocks is stored (edgellm_kernels.h): the row block's fields in this order, each as
# (offset in the row block, bytes, unit): the 8 rows' field stored as [bytes / unit][8 rows][unit] -- a half per row
# (unit 2), scale bytes as [byte][row] (unit 1), quant bytes in runs of 4 per row (unit 4).
_SECTIONS: dict[str, tuple[tuple[int, int, int], ...]] = {
    "q4": ((0, 2, 2), (2, 2, 2), (4, 16, 4)),
    "q8": ((0, 2, 2), (2, 32, 4)),
    "q4_0": ((0, 2, 2), (2, 16, 4)),
    "iq4_nl": ((0, 2, 2), (2, 16, 4)),
    "q5_0": ((0, 2, 2), (2, 4, 4), (6, 16, 4)),
    "q5_1": ((0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 16, 4)),
    "q2_k": ((80, 2, 2), (82, 2, 2), (0, 16, 1), (16, 64, 4)),
    "q3_k": ((108, 2, 2), (96, 12, 1), (32, 64, 4), (0, 32, 4)),
    "q4_k": ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 4)),
    "q5_k": ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 32, 4), (48, 128, 4)),
    "q6_k": ((208, 2, 2), (192, 16, 1), (0, 128, 4), (128, 64, 4)),
}
# q5_0's and q5_1's 32 high bits are stored permuted (stored bit 8 b + t of a row's 4 bytes = GGUF bit _Q5_SOURCE_BIT[8 b + t]):
# bit t < 4 of byte b is element 4 t + b's, bit 4 + t element 16 + 4 t + b's, so the kernels shift them into place
_Q5_SOURCE_BIT = [4 * t + b if t < 4 else 16 + 4 * (t - 4) + b for b in range(4) for t in range(8)]
_Q5_STORED_BIT = [_Q5_SOURCE_BIT.index(e) for e in range(32)]


def _bits(b: Tensor) -> Tensor:
    """uint8 [..., 4] -> [..., 32] (bit e of the little-endian 32-bit word)."""
    return ((b.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(-2)


def _pack_bits(bits: Tensor) -> Tensor:
    """[..., 32] of 0/1 -> uint8 [..., 4], the inverse of _bits."""
    return (bits.view(*bits.shape[:-1], 4, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


_Q5_HIGH_AT = {"q5_0": 2, "q5_1": 4}  # byte offset of the 4 high-bit bytes in the row block


def _permute_q5_high(blocks: Tensor, fmt: str, order: list[int]) -> Tensor:
    """q5_0 / q5_1 row blocks [..., nb * B] with each block's high bits reordered by ``order`` (a copy)."""
    b = blocks.reshape(*blocks.shape[:-1], -1, BLOCK_BYTES[fmt]).clone()
    at = _Q5_HIGH_AT[fmt]
    b[..., at : at + 4] = _pack_bits(_bits(b[..., at : at + 4])[..., order])
    return b.reshape(blocks.shape)


def interleave(blocks: Tensor, fmt: str) -> Tensor:
    """Row blocks uint8 [N, K/Kb * B] (N a multiple of 8; for the GGUF block formats the GGUF's blocks byte for byte)
    -> the stored groups [N/8, K/Kb * 8B]."""
    n, row_bytes = blocks.shape
    if fmt in _Q5_HIGH_AT:
        blocks = _permute_q5_high(blocks, fmt, _Q5_SOURCE_BIT)
    size = BLOCK_BYTES[fmt]
    g, nb = n // ROW_GROUP, row_bytes // size
    b = blocks.reshape(g, ROW_GROUP, nb, size)
    fields = [b[..., off : off + width].reshape(g, ROW_GROUP, nb, width // unit, unit).permute(0, 2, 3, 1, 4)
              .reshape(g, nb, width * ROW_GROUP) for off, width, unit in _SECTIONS[fmt]]
    return torch.cat(fields, dim=-1).reshape(g, nb * size * ROW_GROUP)


def row_blocks(qweight: Tensor, fmt: str, start: int = 0, stop: int | None = None) -> Tensor:
    """Rows ``start:stop`` of a stored block-format weight as row blocks uint8 [rows, K/Kb * B] (a copy)."""
    n = qweight.shape[0] * ROW_GROUP
    stop = n if stop is None else min(stop, n)
    g0, g1 = start // ROW_GROUP, -(-stop // ROW_GROUP)
    size = BLOCK_BYTES[fmt]
    g, nb = g1 - g0, qweight.shape[1] // (size * ROW_GROUP)
    b = qweight[g0:g1].reshape(g, nb, size * ROW_GROUP)
    rows = torch.empty(g, ROW_GROUP, nb, size, dtype=torch.uint8)
    at = 0
    for off, width, unit in _SECTIONS[fmt]:
        field = b[..., at : at + width * ROW_GROUP].reshape(g, nb, width // unit, ROW_GROUP, unit)
        rows[..., off : off + width] = field.permute(0, 3, 1, 2, 4).reshape(g, ROW_GROUP, nb, width)
        at += width * ROW_GROUP
    rows = rows.reshape(g * ROW_GROUP, nb * size)[start - g0 * ROW_GROUP : stop - g0 * ROW_GROUP]
    return _permute_q5_high(rows, fmt, _Q5_STORED_BIT) if fmt in _Q5_HIGH_AT else rows


def _quantize_q8(w: Tensor) -> Parts:
    n, k = w.shape
    g = w.view(n, k // Q4_GROUP, Q4_GROUP)
    scales = _f16_up(g.abs().amax(dim=-1) / 127.0)
    s = scales.float().unsqueeze(-1)
    q = torch.where(s > 0, g / torch.where(s > 0, s, 1.0), 0.0).round_().clamp_(-127, 127)
    blocks = torch.cat((_f16_bytes(scales), q.to(torch.int8).view(torch.uint8)), dim=-1)
    return {"qweight": interleave(blocks.view(n, -1), "q8")}


_Q4_STEPS = [i / 10 for i in range(-10, 11)]  # candidate steps: 15 + step levels across the range


def _fit_q4_range(g: Tensor) -> tuple[Tensor, Tensor]:
    """Per group of 32, the (scale, min) that minimise the squared error of q * scale + min.

    Tries a grid of quantization steps around (max - min) / 15 and, for each rounding pattern, solves
    the least-squares fit of scale and min (the idea behind llama.cpp's k-quant range search).
    The plain min/max range is one of the candidates, so the result is never worse than it.
    """
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    span = (hi - lo).clamp_min(1e-12)
    best_err = torch.full_like(lo, math.inf)
    best_scale, best_min = span / 15.0, lo.clone()
    n = float(g.shape[-1])
    sum_x = g.sum(dim=-1, keepdim=True)
    for step in _Q4_STEPS:
        q = ((g - lo) * ((15.0 + step) / span)).round_().clamp_(0, 15)
        sum_l, sum_l2 = q.sum(dim=-1, keepdim=True), (q * q).sum(dim=-1, keepdim=True)
        sum_xl = (q * g).sum(dim=-1, keepdim=True)
        det = n * sum_l2 - sum_l * sum_l
        ok = det > 0
        det = torch.where(ok, det, 1.0)
        scale = torch.where(ok, (n * sum_xl - sum_l * sum_x) / det, span / 15.0).clamp_min(0.0)
        mn = torch.where(ok, (sum_l2 * sum_x - sum_l * sum_xl) / det, lo)
        err = (q * scale + mn - g).square_().sum(dim=-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, mn, best_min)
    return best_scale.squeeze(-1), best_min.squeeze(-1)


def _quantize_q4(w: Tensor) -> Parts:
    n, k = w.shape
    g = w.view(n, k // Q4_GROUP, Q4_GROUP)
    scale, mn = _fit_q4_range(g)
    scales, mins = scale.half(), mn.half()  # round to the stored precision, then pick q for those values
    s, m = scales.float().unsqueeze(2), mins.float().unsqueeze(2)
    q = torch.where(s > 0, (g - m) / torch.where(s > 0, s, 1.0), 0.0)
    q = q.round_().clamp_(0, 15).to(torch.uint8)
    qs = q[..., : Q4_GROUP // 2] | (q[..., Q4_GROUP // 2 :] << 4)
    blocks = torch.cat((_f16_bytes(scales), _f16_bytes(mins), qs), dim=-1)
    return {"qweight": interleave(blocks.view(n, -1), "q4")}


def quantize(w: Tensor, fmt: str) -> Parts:
    """Store the float weight ``w[N, K]`` in format ``fmt``; returns the parts (CPU tensors).

    Raises UnsupportedQuantizationError for an unknown format, a non-2-D or non-finite weight,
    values that overflow float16, or q4 / q8 with K not a multiple of 32 or N not a multiple of 8.
    """
    check_format(fmt)
    if w.dim() != 2:
        raise UnsupportedQuantizationError(f"can only quantize 2-D weights, got shape {tuple(w.shape)}")
    n, k = w.shape
    if fmt in BLOCK_BYTES and k % BLOCK_WEIGHTS[fmt]:
        raise UnsupportedQuantizationError(
            f"{fmt} needs the input dim to be a multiple of {BLOCK_WEIGHTS[fmt]}, got K={k} (shape [{n}, {k}]); "
            "the converter keeps such a tensor at f16"
        )
    if fmt in BLOCK_BYTES and n % ROW_GROUP:
        raise UnsupportedQuantizationError(
            f"{fmt} needs the output dim to be a multiple of {ROW_GROUP}, got N={n} (shape [{n}, {k}]); "
            "the converter keeps such a tensor at f16"
        )
    w = w.detach().to("cpu", torch.float32).contiguous()
    if not bool(torch.isfinite(w).all()):
        raise UnsupportedQuantizationError(f"weight of shape [{n}, {k}] has NaN or infinite values")
    if fmt == "f32":
        return {"weight": w.clone()}
    if fmt == "f16":
        parts: Parts = {"weight": w.half()}
    elif fmt in SOURCE_ONLY:  # the GGUF block types, made by quant.kquant's search
        parts = {"qweight": interleave(torch.from_numpy(quantize_blocks(w.numpy(), fmt)), fmt)}
    else:
        fn = _quantize_q8 if fmt == "q8" else _quantize_q4
        chunks = [fn(w[i : i + _ROWS_PER_CHUNK]) for i in range(0, n, _ROWS_PER_CHUNK)] or [fn(w)]
        parts = {p: torch.cat([c[p] for c in chunks]) for p in FORMAT_SUFFIXES[fmt]}
    for name, t in _float_fields(parts, fmt).items():
        if not bool(torch.isfinite(t).all()):
            raise UnsupportedQuantizationError(
                f"weight of shape [{n}, {k}] overflows float16 in its {fmt} {name}; keep it at f32"
            )
    return parts


# ---------------------------------------------------------------------------- dequantize / gather


def _float_fields(parts: Parts, fmt: str) -> dict[str, Tensor]:
    """The floating-point fields of ``parts`` by name (block scales and mins for q4 / q8)."""
    if fmt == "q8":
        return {"scales": q8_fields(row_blocks(parts["qweight"], fmt))[0]}
    if fmt == "q4":
        scales, mins, _ = q4_fields(row_blocks(parts["qweight"], fmt))
        return {"scales": scales, "mins": mins}
    return dict(parts)


def _dequant_q4(qweight: Tensor) -> Tensor:
    """float32 [..., K] from q4 row blocks [..., K/32 * 20]; shared by dequantize() and embed_rows()."""
    scales, mins, q = q4_fields(qweight)
    return (q.float() * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)).flatten(-2)


def _dequant_q8(qweight: Tensor) -> Tensor:
    scales, q = q8_fields(qweight)
    return (q.float() * scales.float().unsqueeze(-1)).flatten(-2)


# IQ4_NL's 16 quant values (the format's non-linear grid; el_iq4_nl_values in edgellm_kernels.h)
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _nibbles(qs: Tensor) -> Tensor:
    """A 32-block's 16 quant bytes [..., 16] as its 32 nibbles in element order (byte j: element j low, j + 16 high)."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def _dequant_q4_0(qweight: Tensor) -> Tensor:
    """float32 [..., K] from GGUF Q4_0 row blocks: d * (q - 8), as gguf-py's dequantize computes it."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["q4_0"])
    q = _nibbles(blk[..., 2:]).to(torch.int32) - 8
    return (_f16_from(blk[..., 0:2]).float().unsqueeze(-1) * q.float()).flatten(-2)


def _dequant_iq4_nl(qweight: Tensor) -> Tensor:
    """float32 [..., K] from GGUF IQ4_NL row blocks: d * value[q], as gguf-py's dequantize computes it."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["iq4_nl"])
    values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)[_nibbles(blk[..., 2:]).long()]
    return (_f16_from(blk[..., 0:2]).float().unsqueeze(-1) * values).flatten(-2)


def _dequant_q5_0(qweight: Tensor) -> Tensor:
    """float32 [..., K] from GGUF Q5_0 row blocks: d * (q - 16), as gguf-py's dequantize computes it."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["q5_0"])
    qs = blk[..., 6:]
    q = torch.cat((qs & 15, qs >> 4), dim=-1) | (_bits(blk[..., 2:6]) << 4)
    return (_f16_from(blk[..., 0:2]).float().unsqueeze(-1) * (q.to(torch.int32) - 16).float()).flatten(-2)


def _dequant_q5_1(qweight: Tensor) -> Tensor:
    """float32 [..., K] from GGUF Q5_1 row blocks: d * q + m, as gguf-py's dequantize computes it."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["q5_1"])
    qs = blk[..., 8:]
    q = torch.cat((qs & 15, qs >> 4), dim=-1) | (_bits(blk[..., 4:8]) << 4)
    d, m = _f16_from(blk[..., 0:2]).float().unsqueeze(-1), _f16_from(blk[..., 2:4]).float().unsqueeze(-1)
    return (d * q.float() + m).flatten(-2)


def _crumbs(qs: Tensor) -> Tensor:
    """The 2-bit fields of Q2_K / Q3_K quant bytes [..., 64] in element order [..., 256]: element 128 c + 32 s + l is
    bits 2 s of byte 32 c + l."""
    q = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    return (q & 3).reshape(*qs.shape[:-1], QK_K)


def _dequant_q2_k(qweight: Tensor) -> Tensor:
    """float32 [..., K] from GGUF Q2_K row blocks: (d sc) q - (dmin m) per sub-block of 16, as gguf-py computes it."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["q2_k"])
    lead = blk.shape[:-1]
    sc = blk[..., :16]
    d, dmin = _f16_from(blk[..., 80:82]).float().unsqueeze(-1), _f16_from(blk[..., 82:84]).float().unsqueeze(-1)
    dl, ml = (d * (sc & 15).float()).unsqueeze(-1), (dmin * (sc >> 4).float()).unsqueeze(-1)
    q = _crumbs(blk[..., 16:80]).reshape(*lead, 16, 16).float()
    return (dl * q - ml).flatten(-3)


def _q3_k_scales(s: Tensor) -> Tensor:
    """Q3_K's 16 signed 6-bit scales [..., 16] (int32) from its 12 scale bytes [..., 12]: scale j's low 4 bits are
    byte j % 8's nibble j / 8, its high 2 bits bits 2 (j / 4) of byte 8 + j % 4."""
    low = torch.cat((s[..., :8] & 15, s[..., :8] >> 4), dim=-1)
    hs = s[..., 8:12].unsqueeze(-2) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    high = (hs & 3).flatten(-2)
    return (low | (high << 4)).to(torch.int32) - 32


def _dequant_q3_k(qweight: Tensor) -> Tensor:
    """float32 [..., K] from GGUF Q3_K row blocks: (d sc) (q - 4 (1 - h)) per sub-block of 16, q 2-bit and h the
    element's bit in hmask (bit s of byte l for element 32 s + l), as gguf-py computes it."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["q3_k"])
    lead = blk.shape[:-1]
    d = _f16_from(blk[..., 108:110]).float().unsqueeze(-1)
    dl = (d * _q3_k_scales(blk[..., 96:108]).float()).unsqueeze(-1)
    h = (blk[..., :32].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1  # [..., 8, 32]
    q = _crumbs(blk[..., 32:96]).to(torch.int32) - 4 * (1 - h.reshape(*lead, QK_K).to(torch.int32))
    return (dl * q.reshape(*lead, 16, 16).float()).flatten(-3)


def _q4_k_scale_min(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's 6-bit scales and mins [..., 8] from its 12 scale bytes [..., 12] (llama.cpp's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 6) << 4)), dim=-1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 6) << 4)), dim=-1)
    return sc, mn


def _dequant_q4_k(qweight: Tensor) -> Tensor:
    """float32 [..., K] from GGUF Q4_K row blocks: (d sc) q - (dmin m) per sub-block of 32, as gguf-py computes it."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["q4_k"])
    d, dmin = _f16_from(blk[..., 0:2]).float(), _f16_from(blk[..., 2:4]).float()
    sc, mn = _q4_k_scale_min(blk[..., 4:16])
    ds, dm = (d.unsqueeze(-1) * sc.float()).unsqueeze(-1), (dmin.unsqueeze(-1) * mn.float()).unsqueeze(-1)
    qs = blk[..., 16:].reshape(*blk.shape[:-1], 4, 1, 32)
    q = torch.cat((qs & 15, qs >> 4), dim=-2).reshape(*blk.shape[:-1], 8, 32).float()
    return (ds * q - dm).flatten(-3)


def _dequant_q5_k(qweight: Tensor) -> Tensor:
    """float32 [..., K] from GGUF Q5_K row blocks: (d sc) q - (dmin m) per sub-block of 32, q = nibble | bit j of
    qh[l] << 4 for element 32 j + l, as gguf-py computes it."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["q5_k"])
    lead = blk.shape[:-1]
    d, dmin = _f16_from(blk[..., 0:2]).float(), _f16_from(blk[..., 2:4]).float()
    sc, mn = _q4_k_scale_min(blk[..., 4:16])
    ds, dm = (d.unsqueeze(-1) * sc.float()).unsqueeze(-1), (dmin.unsqueeze(-1) * mn.float()).unsqueeze(-1)
    qs = blk[..., 48:].reshape(*lead, 4, 1, 32)
    low = torch.cat((qs & 15, qs >> 4), dim=-2).reshape(*lead, 8, 32)
    high = (blk[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1  # [..., 8, 32]
    return (ds * (low | (high << 4)).float() - dm).flatten(-3)


def _dequant_q6_k(qweight: Tensor) -> Tensor:
    """float32 [..., K] from GGUF Q6_K row blocks: (d sc) (q - 32) per sub-block of 16, as gguf-py computes it."""
    blk = qweight.view(*qweight.shape[:-1], -1, BLOCK_BYTES["q6_k"])
    lead = blk.shape[:-1]
    ql = blk[..., :128].reshape(*lead, 2, 1, 64)
    ql = torch.cat((ql & 15, ql >> 4), dim=-2).reshape(*lead, 8, 32)
    qh = blk[..., 128:192].reshape(*lead, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    q = (ql | ((qh & 3).reshape(*lead, 8, 32) << 4)).to(torch.int32) - 32
    scales = blk[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16_from(blk[..., 208:210]).float().unsqueeze(-1) * scales
    return (d.unsqueeze(-1) * q.reshape(*lead, 16, 16).float()).flatten(-3)


_DEQUANT = {"q4": _dequant_q4, "q8": _dequant_q8, "q4_0": _dequant_q4_0, "iq4_nl": _dequant_iq4_nl, "q5_0": _dequant_q5_0, "q5_1": _dequant_q5_1, "q2_k": _dequant_q2_k,
            "q3_k": _dequant_q3_k, "q4_k": _dequant_q4_k, "q5_k": _dequant_q5_k, "q6_k": _dequant_q6_k}


def dequant_rows(blocks: Tensor, fmt: str) -> Tensor:
    """float32 [..., K] from row blocks [..., K/Kb * B] of block format ``fmt``."""
    return _DEQUANT[fmt](blocks)


def dequantize(parts: Parts, fmt: str) -> Tensor:
    """The float32 [N, K] weight that ``parts`` (format ``fmt``) represent."""
    weight_shape(fmt, parts)
    if fmt in ("f32", "f16"):
        return parts["weight"].float()
    return _DEQUANT[fmt](row_blocks(parts["qweight"], fmt))


def embed_rows(ids: Tensor, parts: Parts, fmt: str) -> Tensor:
    """float32 [..., K] rows ``ids`` of the weight, dequantizing only the gathered rows.

    Bit-identical to ``dequantize(parts, fmt)[ids]``.
    """
    if fmt in ("f32", "f16"):
        return torch.nn.functional.embedding(ids, parts["weight"]).float()
    if fmt in BLOCK_BYTES:
        flat = ids.reshape(-1)
        groups = row_blocks(parts["qweight"][flat // ROW_GROUP], fmt).view(flat.numel(), ROW_GROUP, -1)
        rows = groups[torch.arange(flat.numel()), flat % ROW_GROUP].view(*ids.shape, -1)
        return _DEQUANT[fmt](rows)
    check_format(fmt)
    raise AssertionError(fmt)
