"""Portable, safetensors-friendly weight formats: quantize, dequantize, sizes, row gathers.

A weight ``W[N, K]`` (N outputs, K inputs) is stored as one or more *parts*; in a safetensors file
part ``p`` of the weight at ``prefix`` is the tensor ``f"{prefix}.{p}"``. No torch-internal packed
layout is ever written to disk; kernels repack at load (see :mod:`edgellm.quant.dispatch`).

=======  =====================================================================================
format   parts
=======  =====================================================================================
``f32``  ``weight`` float32 [N, K]
``f16``  ``weight`` float16 [N, K]
``q8``   ``qweight`` int8 [N, K], ``scales`` float16 [N];  W = qweight * scale (symmetric)
``q4``   ``qweight`` uint8 [N, K/2] (low nibble = even k, high nibble = odd k),
         ``scales`` float16 [N, K/32], ``mins`` float16 [N, K/32];  W = q * scale + min, q in 0..15
=======  =====================================================================================

Rounding: q8 rounds its scale *up* to f16 (so ``|w| / scale <= 127``); q4 rounds its min *down*
and its scale *up* to f16 (so every w lies in ``[min, min + 15 * scale]``). q is then the
round-to-nearest grid index under the stored (f16) scale/min, which makes the per-weight error
the minimum possible for those stored values, and at most ``scale / 2``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from edgellm.errors import ArtifactError, UnsupportedQuantizationError

Parts = dict[str, Tensor]

Q4_GROUP = 32
FORMAT_SUFFIXES: dict[str, tuple[str, ...]] = {
    "f32": ("weight",),
    "f16": ("weight",),
    "q8": ("qweight", "scales"),
    "q4": ("qweight", "scales", "mins"),
}
FORMATS: tuple[str, ...] = tuple(FORMAT_SUFFIXES)
_ROWS_PER_CHUNK = 4096  # bounds quantize()'s temporaries for huge embeddings


def check_format(fmt: str) -> None:
    """Raise UnsupportedQuantizationError unless ``fmt`` is a known format."""
    if fmt not in FORMAT_SUFFIXES:
        raise UnsupportedQuantizationError(
            f"unknown weight format {fmt!r}; known formats: {', '.join(FORMATS)}"
        )


def tensor_names(prefix: str, fmt: str) -> list[str]:
    """Safetensors names of the parts of the weight at ``prefix``, e.g. ``m.up_proj.qweight``."""
    check_format(fmt)
    return [f"{prefix}.{p}" for p in FORMAT_SUFFIXES[fmt]]


# ---------------------------------------------------------------------------- f16 directed rounding


def _f16_down(x: Tensor) -> Tensor:
    """Largest float16 <= x (x float32)."""
    h = x.half()
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -math.inf)), h)


def _f16_up(x: Tensor) -> Tensor:
    """Smallest float16 >= x (x float32)."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, math.inf)), h)


# ---------------------------------------------------------------------------- quantize


def _quantize_q8(w: Tensor) -> Parts:
    scales = _f16_up(w.abs().amax(dim=1) / 127.0)
    s = scales.float().unsqueeze(1)
    q = torch.where(s > 0, w / torch.where(s > 0, s, 1.0), 0.0).round_().clamp_(-127, 127)
    return {"qweight": q.to(torch.int8), "scales": scales}


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
    q = q.round_().clamp_(0, 15).to(torch.uint8).view(n, k // 2, 2)
    packed = q[..., 0] | (q[..., 1] << 4)
    return {"qweight": packed, "scales": scales, "mins": mins}


def quantize(w: Tensor, fmt: str) -> Parts:
    """Store the float weight ``w[N, K]`` in format ``fmt``; returns the parts (CPU tensors).

    Raises UnsupportedQuantizationError for an unknown format, a non-2-D or non-finite weight,
    values that overflow float16, or q4 with K not a multiple of 32.
    """
    check_format(fmt)
    if w.dim() != 2:
        raise UnsupportedQuantizationError(f"can only quantize 2-D weights, got shape {tuple(w.shape)}")
    n, k = w.shape
    if fmt == "q4" and k % Q4_GROUP:
        raise UnsupportedQuantizationError(
            f"q4 needs the input dim to be a multiple of {Q4_GROUP}, got K={k} (shape [{n}, {k}]); "
            "the converter keeps such a tensor at f16"
        )
    w = w.detach().to("cpu", torch.float32).contiguous()
    if not bool(torch.isfinite(w).all()):
        raise UnsupportedQuantizationError(f"weight of shape [{n}, {k}] has NaN or infinite values")
    if fmt == "f32":
        return {"weight": w.clone()}
    if fmt == "f16":
        parts: Parts = {"weight": w.half()}
    else:
        fn = _quantize_q8 if fmt == "q8" else _quantize_q4
        chunks = [fn(w[i : i + _ROWS_PER_CHUNK]) for i in range(0, n, _ROWS_PER_CHUNK)] or [fn(w)]
        parts = {p: torch.cat([c[p] for c in chunks]) for p in FORMAT_SUFFIXES[fmt]}
    for name, t in parts.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UnsupportedQuantizationError(
                f"weight of shape [{n}, {k}] overflows float16 in its {fmt} {name}; keep it at f32"
            )
    return parts


# ---------------------------------------------------------------------------- dequantize / gather


def unpack_q4(qweight: Tensor) -> Tensor:
    """uint8 [..., K/2] nibble pairs -> uint8 [..., K] values 0..15 (even k = low nibble)."""
    return torch.stack((qweight & 15, qweight >> 4), dim=-1).flatten(-2)


def _dequant_q4(qweight: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """float32 q * scale + min over any leading dims; shared by dequantize() and embed_rows()."""
    q = unpack_q4(qweight).unflatten(-1, (-1, Q4_GROUP)).float()
    w = q * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
    return w.flatten(-2)


def _dequant_q8(qweight: Tensor, scales: Tensor) -> Tensor:
    return qweight.float() * scales.float().unsqueeze(-1)


def dequantize(parts: Parts, fmt: str) -> Tensor:
    """The float32 [N, K] weight that ``parts`` (format ``fmt``) represent."""
    weight_shape(fmt, parts)
    if fmt in ("f32", "f16"):
        return parts["weight"].float()
    if fmt == "q8":
        return _dequant_q8(parts["qweight"], parts["scales"])
    return _dequant_q4(parts["qweight"], parts["scales"], parts["mins"])


def embed_rows(ids: Tensor, parts: Parts, fmt: str) -> Tensor:
    """float32 [..., K] rows ``ids`` of the weight, dequantizing only the gathered rows.

    Bit-identical to ``dequantize(parts, fmt)[ids]``.
    """
    if fmt in ("f32", "f16"):
        return torch.nn.functional.embedding(ids, parts["weight"]).float()
    if fmt == "q8":
        return _dequant_q8(parts["qweight"][ids], parts["scales"][ids])
    if fmt == "q4":
        return _dequant_q4(parts["qweight"][ids], parts["scales"][ids], parts["mins"][ids])
    check_format(fmt)
    raise AssertionError(fmt)


# ---------------------------------------------------------------------------- validation and sizes

_DTYPES: dict[str, dict[str, torch.dtype]] = {
    "f32": {"weight": torch.float32},
    "f16": {"weight": torch.float16},
    "q8": {"qweight": torch.int8, "scales": torch.float16},
    "q4": {"qweight": torch.uint8, "scales": torch.float16, "mins": torch.float16},
}


def _expected_shapes(fmt: str, n: int, k: int) -> dict[str, tuple[int, ...]]:
    if fmt in ("f32", "f16"):
        return {"weight": (n, k)}
    if fmt == "q8":
        return {"qweight": (n, k), "scales": (n,)}
    return {"qweight": (n, k // 2), "scales": (n, k // Q4_GROUP), "mins": (n, k // Q4_GROUP)}


def weight_shape(fmt: str, parts: Parts) -> tuple[int, int]:
    """The logical ``(N, K)`` of ``parts``; raises ArtifactError if parts are missing or malformed."""
    check_format(fmt)
    missing = [p for p in FORMAT_SUFFIXES[fmt] if p not in parts]
    if missing:
        raise ArtifactError(f"{fmt} weight is missing part(s) {', '.join(missing)} (has {', '.join(parts)})")
    main = parts["weight" if fmt in ("f32", "f16") else "qweight"]
    if main.dim() != 2:
        raise ArtifactError(f"{fmt} weight must be 2-D, got shape {tuple(main.shape)}")
    n, k = main.shape[0], main.shape[1] * (2 if fmt == "q4" else 1)
    if fmt == "q4" and k % Q4_GROUP:
        raise ArtifactError(f"q4 weight has K={k}, not a multiple of {Q4_GROUP}")
    for p, shape in _expected_shapes(fmt, n, k).items():
        t, dtype = parts[p], _DTYPES[fmt][p]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ArtifactError(
                f"{fmt} part {p!r} should be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}"
            )
    return n, k


def storage_bytes(fmt: str, shape: tuple[int, int]) -> int:
    """Exact bytes the parts of an ``[N, K]`` weight occupy in format ``fmt``."""
    check_format(fmt)
    n, k = shape
    if fmt == "q4" and k % Q4_GROUP:
        raise UnsupportedQuantizationError(f"q4 needs K to be a multiple of {Q4_GROUP}, got {k}")
    return sum(
        math.prod(s) * _DTYPES[fmt][p].itemsize for p, s in _expected_shapes(fmt, n, k).items()
    )


def bits_per_weight(fmt: str, shape: tuple[int, int] | None = None) -> float:
    """Storage bits per weight: exact for ``shape``, else the large-K value.

    f32 32, f16 16, q4 4 + 2*16/32 = 5.0 (any shape), q8 8 + 16/K (8.0 without a shape).
    """
    check_format(fmt)
    if shape is None:
        return {"f32": 32.0, "f16": 16.0, "q8": 8.0, "q4": 5.0}[fmt]
    return 8.0 * storage_bytes(fmt, shape) / (shape[0] * shape[1])
