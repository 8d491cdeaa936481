"""Quantize float weights into GGUF's own blocks: Q4_K, Q6_K and Q5_0 (numpy, vectorized over all blocks).

The bytes are the GGUF block layouts byte for byte (``quant/formats.py`` reads them, gguf-py's ``dequantize`` agrees),
so ``formats.interleave`` stores them as the ``q4_k`` / ``q6_k`` / ``q5_0`` weights the native kernels stream.

How the values are chosen (the idea of llama.cpp's reference quantizer, searched more finely):

- every (sub-)block's scale -- and for Q4_K its min -- is searched over a grid of candidate steps around the plain
  range fit; for each candidate's rounding pattern the scale (and min) is the weighted least-squares fit, and the
  candidate with the least weighted squared error wins; then the rounding is redone under that fit until it no longer
  improves (a few passes);
- the sub-block scales are then quantized against the super-block's f16 scale (Q4_K: 6-bit scales and mins, Q6_K:
  int8 scales), and each weight's grid index is picked last, under the values actually stored.

The weights of the error: Q4_K and Q5_0 ``rms(block) + |x|``, Q6_K ``x**2`` (llama.cpp's choices for Q4_K / Q6_K).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from edgellm.errors import UnsupportedQuantizationError

F32 = NDArray[np.float32]
U8 = NDArray[np.uint8]

QK_K = 256
Q5_0_BLOCK = 32
ROW_BYTES = {"q4_k": 144, "q6_k": 210, "q5_0": 22}  # bytes of one block (256, 256, 32 weights)
BLOCK = {"q4_k": QK_K, "q6_k": QK_K, "q5_0": Q5_0_BLOCK}
_CHUNK = 1 << 18  # weights searched at a time (bounds the temporaries)
_REFINE_PASSES = 3


def _rint(x: F32) -> F32:
    return np.rint(x, out=x)


def _f16(x: F32) -> F32:
    """x rounded to float16, as float32 (the stored precision)."""
    return x.astype(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------- per-block searches


def _search_symmetric(x: F32, w: F32, nneg: int, npos: int) -> F32:
    """Per row of ``x`` [M, B]: the scale s minimising sum w (x - s q)^2 over q in -nneg..npos, by a grid of candidate
    steps that map the largest magnitude onto either end of the grid, each refit by weighted least squares."""
    amax_i = np.argmax(np.abs(x), axis=1)
    vmax = x[np.arange(x.shape[0]), amax_i]
    ok = vmax != 0
    safe = np.where(ok, vmax, 1.0).astype(np.float32)
    best_s = np.zeros(x.shape[0], np.float32)
    best_score = np.full(x.shape[0], -1.0, np.float32)  # sum(wxq)^2 / sum(wq^2): the error decrease of the fit
    wx = w * x

    def consider(q: F32) -> None:
        nonlocal best_s, best_score
        sum_xq = np.einsum("ij,ij->i", wx, q)
        sum_q2 = np.einsum("ij,ij->i", w * q, q)
        good = sum_q2 > 0
        d = np.where(good, sum_q2, 1.0)
        score = np.where(good, sum_xq * sum_xq / d, -1.0)
        better = ok & (score > best_score)
        best_score = np.where(better, score, best_score)
        best_s = np.where(better, sum_xq / d, best_s)

    for end in (-float(nneg), float(npos)):  # the largest magnitude onto the negative end, or the positive one
        for step in np.arange(-1.0, 1.0001, 0.05):
            iscale = (end + np.sign(end) * step).astype(np.float32) / safe
            consider(np.clip(_rint(x * iscale[:, None]), -nneg, npos))
    for _ in range(_REFINE_PASSES):  # re-round under the fitted scale, refit
        inv = np.where(best_s != 0, 1.0 / np.where(best_s != 0, best_s, 1.0), 0.0).astype(np.float32)
        consider(np.clip(_rint(x * inv[:, None]), -nneg, npos))
    return best_s


def _search_affine(x: F32, w: F32, nmax: int) -> tuple[F32, F32]:
    """Per row of ``x`` [M, B]: (scale >= 0, offset <= 0) minimising sum w (x - (scale q + offset))^2 over q in
    0..nmax: candidate steps around (max - min) / nmax, each rounding pattern refit by weighted least squares (the
    offset clamped to <= 0, as Q4_K stores it as a subtracted min)."""
    lo = np.minimum(x.min(axis=1), 0.0).astype(np.float32)
    hi = x.max(axis=1)
    span = hi - lo
    ok = span > 0
    inv_span = np.where(ok, 1.0 / np.where(ok, span, 1.0), 0.0).astype(np.float32)
    sw = w.sum(axis=1)
    swx = np.einsum("ij,ij->i", w, x)
    swx2 = np.einsum("ij,ij->i", w * x, x)
    best_s = np.zeros(x.shape[0], np.float32)
    best_m = lo.copy()
    best_err = np.where(ok, np.inf, 0.0).astype(np.float32)
    xs = x - lo[:, None]

    def consider(q: F32) -> None:
        nonlocal best_s, best_m, best_err
        wq = w * q
        swq = wq.sum(axis=1)
        swq2 = np.einsum("ij,ij->i", wq, q)
        swxq = np.einsum("ij,ij->i", wq, x)
        det = sw * swq2 - swq * swq
        good = det > 0
        det = np.where(good, det, 1.0)
        s = (sw * swxq - swq * swx) / det
        m = (swq2 * swx - swq * swxq) / det
        alone = ~good | (m > 0)  # all q equal, or a positive offset: fit the scale alone, offset 0
        s = np.where(alone, swxq / np.where(swq2 > 0, swq2, 1.0), s)
        m = np.where(alone, 0.0, m)
        err = swx2 - 2 * s * swxq - 2 * m * swx + s * s * swq2 + 2 * s * m * swq + m * m * sw
        better = ok & (good | (swq2 > 0)) & (s >= 0) & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s, best_s)
        best_m = np.where(better, m, best_m)

    for step in np.arange(-1.0, 1.0001, 0.05):
        iscale = ((nmax + step) * inv_span).astype(np.float32)
        consider(np.clip(_rint(xs * iscale[:, None]), 0, nmax))
    for _ in range(_REFINE_PASSES):
        inv = np.where(best_s > 0, 1.0 / np.where(best_s > 0, best_s, 1.0), 0.0).astype(np.float32)
        consider(np.clip(_rint((x - best_m[:, None]) * inv[:, None]), 0, nmax))
    return best_s.astype(np.float32), best_m.astype(np.float32)


def _spread_weights(x: F32) -> F32:
    """rms(block) + |x| per weight of each block row (llama.cpp's Q4_K weighting)."""
    return (np.sqrt(np.mean(x * x, axis=1, keepdims=True)) + np.abs(x)).astype(np.float32)


def _pick(x: F32, step: F32, offset: F32, lo: int, hi: int) -> F32:
    """Grid indices of x [M, B] under the stored step and offset [M] (rows with step 0 get index ``max(lo, 0)``)."""
    live = step != 0
    inv = np.where(live, 1.0 / np.where(live, step, 1.0), 0.0).astype(np.float32)
    q = np.clip(_rint((x - offset[:, None]) * inv[:, None]), lo, hi)
    return np.where(live[:, None], q, max(lo, 0)).astype(np.float32)


# ---------------------------------------------------------------------------- the three block types


def _weighted_error(x: F32, w: F32, step: F32, offset: F32, q: F32, groups: int) -> F32:
    """sum w (step q + offset - x)^2 per super-block, over its ``groups`` consecutive block rows."""
    r = step[:, None] * q + offset[:, None] - x
    return np.einsum("ij,ij->i", w * r, r).reshape(-1, groups).sum(axis=1)


def _q4_k_fields(sub: F32, w: F32, d: F32, dmin: F32, ls: F32, lm: F32) -> tuple[F32, F32, F32, F32]:
    """(step, offset, q, error) of Q4_K sub-blocks [nb * 8, 32] under the stored d, dmin [nb] and 6-bit ls, lm [nb, 8]."""
    step = (d[:, None] * ls).reshape(-1)
    offset = -(dmin[:, None] * lm).reshape(-1)
    q = _pick(sub, step, offset, 0, 15)
    return step, offset, q, _weighted_error(sub, w, step, offset, q, 8)


def _nudge_q4_k(sub: F32, w: F32, d: F32, dmin: F32, ls: F32, lm: F32) -> tuple[F32, F32]:
    """Each sub-block's 6-bit scale and min moved by -1, 0 or +1 each, whichever pair gives the least error under the
    super-block's d and dmin (the rounding to 6 bits done against the error, not the fitted values)."""
    best_ls, best_lm, best = ls, lm, None
    for ds in (0.0, -1.0, 1.0):
        for dm in (0.0, -1.0, 1.0):
            cls, clm = np.clip(ls + ds, 0, 63), np.clip(lm + dm, 0, 63)
            step, offset = (d[:, None] * cls).reshape(-1), -(dmin[:, None] * clm).reshape(-1)
            q = _pick(sub, step, offset, 0, 15)
            err = _weighted_error(sub, w, step, offset, q, 1).reshape(ls.shape)
            if best is None:
                best = err
                continue
            better = err < best
            best = np.where(better, err, best)
            best_ls, best_lm = np.where(better, cls, best_ls), np.where(better, clm, best_lm)
    return best_ls, best_lm


def _q4_k(x: F32) -> U8:
    """GGUF Q4_K blocks [nb, 144] of x [nb, 256]."""
    nb = x.shape[0]
    sub = x.reshape(nb * 8, 32)
    w = _spread_weights(sub)
    scale, offset = _search_affine(sub, w, 15)
    scale, mins = scale.reshape(nb, 8), (-offset).reshape(nb, 8)
    d = _f16(scale.max(axis=1) / 63.0)
    dmin = _f16(mins.max(axis=1) / 63.0)
    inv_d = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0).astype(np.float32)
    inv_dm = np.where(dmin > 0, 1.0 / np.where(dmin > 0, dmin, 1.0), 0.0).astype(np.float32)
    ls = np.clip(np.rint(scale * inv_d[:, None]), 0, 63).astype(np.float32)
    lm = np.clip(np.rint(mins * inv_dm[:, None]), 0, 63).astype(np.float32)
    ls, lm = _nudge_q4_k(sub, w, d, dmin, ls, lm)
    _, _, q, err = _q4_k_fields(sub, w, d, dmin, ls, lm)
    for _ in range(_REFINE_PASSES):  # refit d and dmin to the chosen integers by weighted least squares, re-pick q
        a = (ls.reshape(-1)[:, None] * q).reshape(nb, 256)
        b = np.repeat(-lm, 32, axis=1)
        wf, xf = w.reshape(nb, 256), x
        saa, sbb, sab = (np.einsum("ij,ij->i", wf * u, v) for u, v in ((a, a), (b, b), (a, b)))
        sax, sbx = np.einsum("ij,ij->i", wf * a, xf), np.einsum("ij,ij->i", wf * b, xf)
        det = saa * sbb - sab * sab
        good = det > 0
        det = np.where(good, det, 1.0)
        nd = _f16(np.where(good, (sax * sbb - sbx * sab) / det, d).astype(np.float32))
        ndm = _f16(np.where(good, (sbx * saa - sax * sab) / det, dmin).astype(np.float32))
        good &= (nd >= 0) & (ndm >= 0)
        nd, ndm = np.where(good, nd, d), np.where(good, ndm, dmin)
        _, _, nq, nerr = _q4_k_fields(sub, w, nd, ndm, ls, lm)
        better = nerr < err
        d, dmin, err = np.where(better, nd, d), np.where(better, ndm, dmin), np.where(better, nerr, err)
        q = np.where(np.repeat(better, 8)[:, None], nq, q)
    qb = q.astype(np.uint8).reshape(nb, 8, 32)
    lsb, lmb = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.empty((nb, 144), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(nb, 2)
    out[:, 4:8] = (lsb[:, :4] & 63) | ((lsb[:, 4:] >> 4) << 6)
    out[:, 8:12] = (lmb[:, :4] & 63) | ((lmb[:, 4:] >> 4) << 6)
    out[:, 12:16] = (lsb[:, 4:] & 15) | ((lmb[:, 4:] & 15) << 4)
    out[:, 16:] = (qb[:, 0::2] | (qb[:, 1::2] << 4)).reshape(nb, 128)  # sub-block 2i low nibbles, 2i + 1 high
    return out


def _q6_k(x: F32) -> U8:
    """GGUF Q6_K blocks [nb, 210] of x [nb, 256]."""
    nb = x.shape[0]
    sub = x.reshape(nb * 16, 16)
    scale = _search_symmetric(sub, sub * sub, 32, 31).reshape(nb, 16)
    big = scale[np.arange(nb), np.argmax(np.abs(scale), axis=1)]
    ok = big != 0
    iscale = np.where(ok, -128.0 / np.where(ok, big, 1.0), 0.0).astype(np.float32)
    sc = np.clip(np.rint(scale * iscale[:, None]), -128, 127).astype(np.int8)
    d = _f16(np.where(ok, 1.0 / np.where(ok, iscale, 1.0), 0.0).astype(np.float32))
    w = sub * sub
    best_sc, best = sc.astype(np.float32), None
    for delta in (0.0, -1.0, 1.0):  # each int8 scale moved by -1, 0 or +1, whichever gives the least error under d
        csc = np.clip(sc.astype(np.float32) + delta, -128, 127)
        step = (d[:, None] * csc).reshape(-1)
        err = _weighted_error(sub, w, step, np.zeros_like(step), _pick(sub, step, np.zeros_like(step), -32, 31), 1)
        err = err.reshape(nb, 16)
        better = err < best if best is not None else np.zeros_like(err, dtype=bool)
        best = err if best is None else np.where(better, err, best)
        best_sc = np.where(better, csc, best_sc)
    sc = best_sc.astype(np.int8)
    step = (d[:, None] * best_sc).reshape(-1)
    q = (_pick(sub, step, np.zeros_like(step), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    out = np.empty((nb, 210), np.uint8)
    # element 128 h + 32 t + l: low nibble in ql[64 h + 32 (t % 2) + l] (t < 2 low nibble, else high), 2 high bits at
    # bit 2 t of qh[32 h + l]
    ql = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)
    out[:, :128] = ql.reshape(nb, 128)
    hi = q >> 4
    out[:, 128:192] = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(nb, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return out


def _q5_0(x: F32) -> U8:
    """GGUF Q5_0 blocks [nb, 22] of x [nb, 32]."""
    nb = x.shape[0]
    d = _f16(_search_symmetric(x, _spread_weights(x), 16, 15))
    q = (_pick(x, d, np.zeros_like(d), -16, 15) + 16).astype(np.uint8)
    out = np.empty((nb, 22), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    out[:, 2:6] = bits.sum(axis=1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(nb, 4)
    out[:, 6:] = (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)
    return out


_QUANTIZERS = {"q4_k": _q4_k, "q6_k": _q6_k, "q5_0": _q5_0}


def quantize_blocks(w: NDArray[np.floating], fmt: str) -> U8:
    """GGUF row blocks uint8 [N, K / block * bytes] of the float weight ``w`` [N, K] in ``fmt`` (q4_k, q6_k, q5_0).

    Raises UnsupportedQuantizationError for another format, a non-2-D or non-finite weight, K not a multiple of the
    block, or a weight whose scales overflow float16."""
    if fmt not in _QUANTIZERS:
        raise UnsupportedQuantizationError(f"no K-quant quantizer for {fmt!r}; known: {', '.join(_QUANTIZERS)}")
    if w.ndim != 2:
        raise UnsupportedQuantizationError(f"can only quantize 2-D weights, got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % BLOCK[fmt]:
        raise UnsupportedQuantizationError(
            f"{fmt} needs the input dim to be a multiple of {BLOCK[fmt]}, got K={k} (shape [{n}, {k}])")
    x = np.ascontiguousarray(w, dtype=np.float32)
    if not np.isfinite(x).all():
        raise UnsupportedQuantizationError(f"weight of shape [{n}, {k}] has NaN or infinite values")
    blocks = x.reshape(-1, BLOCK[fmt])
    per = max(1, _CHUNK // BLOCK[fmt])
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.concatenate([_QUANTIZERS[fmt](blocks[i : i + per]) for i in range(0, blocks.shape[0], per)]
                             or [np.empty((0, ROW_BYTES[fmt]), np.uint8)])
    halves = {"q4_k": (0, 4), "q6_k": (208, 210), "q5_0": (0, 2)}[fmt]
    if not np.isfinite(out[:, halves[0] : halves[1]].copy().view(np.float16)).all():
        raise UnsupportedQuantizationError(
            f"weight of shape [{n}, {k}] overflows float16 in its {fmt} scales; keep it at f32")
    return out.reshape(n, k // BLOCK[fmt] * ROW_BYTES[fmt])
