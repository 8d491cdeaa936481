"""The GGUF blocks edgellm holds exactly (q4_0, iq4_nl, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k: llama.cpp's types of
those names),
proved against gguf-py and float64.

* quant/formats: interleaving is a permutation (row blocks back byte for byte) and dequantize equals gguf-py's
  ``dequantize`` bit for bit, on random blocks (every scale / min / quant bit pattern, halves of every magnitude) and
  on the real catalog files' tensors;
* the native library's dequantization is exact in every variant this machine runs: el_gemm_f32 times the identity
  gives the weights themselves (each output one multiply-add chain, w * 1 plus zeros), el_gemm_bf16 (where
  AVX512-BF16 runs) their bf16 roundings, el_dequant_bf16 likewise;
* the decode GEMV (el_linear: int8 activation blocks) against float64 sums of the same quantized operands, within
  (nbx + 8) * 2^-24 * the sum of the magnitudes of every term a kernel may form (its products, and the offset terms
  16 d s / 32 d dx sum|qx| / dmin m s that it may take off separately, _reference lists them per format): float32 rounding of at most nbx + 8 partial
  sums, derived from the formats, not tuned.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from edgellm.kernels import abi, native
from edgellm.quant.formats import (BLOCK_BYTES, BLOCK_WEIGHTS, EL_FORMAT_CODES, dequant_rows, dequantize, interleave,
                                   row_blocks, storage_bytes)
from edgellm.quant.layout import expected_shapes

QTYPES = {"q4_0": T.Q4_0, "iq4_nl": T.IQ4_NL, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "q2_k": T.Q2_K, "q3_k": T.Q3_K, "q4_k": T.Q4_K, "q5_k": T.Q5_K,
          "q6_k": T.Q6_K}
CATALOG_TYPES = ("q5_0", "q4_k", "q6_k")  # the types the catalog files hold (the others: tests/test_gguf_kquants.py)
# byte offsets of each block's f16 fields
HALF_FIELDS = {"q4_0": (0,), "iq4_nl": (0,), "q5_0": (0,), "q5_1": (0, 2), "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2),
               "q6_k": (208,)}
U = 2.0**-24


def random_blocks(fmt: str, n: int, k: int, seed: int, magnitude: float = 1e-3) -> torch.Tensor:
    """Random valid GGUF row blocks [n, k / Kb * B]: every quant and scale byte random, each f16 field a random
    positive half of about ``magnitude`` (times 2^-3 .. 2^3) or, in one block in 8, zero."""
    g = np.random.default_rng(seed)
    nb = k // BLOCK_WEIGHTS[fmt]
    raw = g.integers(0, 256, (n, nb, BLOCK_BYTES[fmt]), dtype=np.uint8)
    for off in HALF_FIELDS[fmt]:
        h = (magnitude * 2.0 ** g.uniform(-3, 3, (n, nb))).astype(np.float16)
        h[g.random((n, nb)) < 0.125] = 0
        raw[..., off : off + 2] = h.view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def gguf_values(fmt: str, blocks: torch.Tensor) -> np.ndarray:
    return gguf_dequantize(blocks.numpy(), QTYPES[fmt]).astype(np.float32).reshape(blocks.shape[0], -1)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------------------- formats vs gguf-py


@pytest.mark.parametrize("fmt", list(QTYPES))
def test_dequantize_equals_gguf_py_on_random_blocks(fmt: str) -> None:
    blocks = random_blocks(fmt, 64, 3 * BLOCK_WEIGHTS[fmt], seed=1)
    raw = blocks.clone()
    raw.view(64, 3, -1)[..., HALF_FIELDS[fmt][0] + 1] ^= 0x80  # negative scales too
    for b in (blocks, raw):
        stored = interleave(b, fmt)
        assert stored.shape == (8, 3 * BLOCK_BYTES[fmt] * 8) == expected_shapes(fmt, 64, 3 * BLOCK_WEIGHTS[fmt])["qweight"]
        assert storage_bytes(fmt, (64, 3 * BLOCK_WEIGHTS[fmt])) == stored.numel() == b.numel()  # the GGUF's bytes
        assert torch.equal(row_blocks(stored, fmt), b)  # the interleave is a permutation
        assert torch.equal(row_blocks(stored, fmt, 13, 30), b[13:30])
        assert same_bits(dequantize({"qweight": stored}, fmt).numpy(), gguf_values(fmt, b))
        assert same_bits(dequant_rows(b, fmt).numpy(), gguf_values(fmt, b))


@pytest.fixture(scope="module")
def file_tensors(qwen_gguf: Path, gemma3_gguf: Path) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Up to 3 tensors of each type from each catalog file: their first 256 rows (whole row groups) as stored."""
    out: dict[str, list[tuple[str, torch.Tensor]]] = {fmt: [] for fmt in CATALOG_TYPES}
    for path in (qwen_gguf, gemma3_gguf):
        taken = dict.fromkeys(CATALOG_TYPES, 0)
        for t in GGUFReader(path).tensors:
            fmt = next((f for f in CATALOG_TYPES if QTYPES[f] == t.tensor_type), None)
            if fmt is not None and taken[fmt] < 3:
                data = t.data.reshape(int(t.shape[-1]), -1)[:256]
                out[fmt].append((f"{path.name}:{t.name}", torch.from_numpy(np.array(data, dtype=np.uint8))))
                taken[fmt] += 1
    return out


@pytest.mark.parametrize("fmt", CATALOG_TYPES)
def test_dequantize_equals_gguf_py_on_the_catalog_files(fmt: str, file_tensors: dict[str, list[tuple[str, torch.Tensor]]]) -> None:
    assert len(file_tensors[fmt]) >= 2
    for name, raw in file_tensors[fmt]:
        ours = dequantize({"qweight": interleave(raw, fmt)}, fmt).numpy()
        assert same_bits(ours, gguf_values(fmt, raw)), name


# ---------------------------------------------------------------------------- the native library


def _runnable() -> list[str]:
    scalar = native._scalar_library(native.LIB_DIR)
    return [v for v in native.variant_names() if native.verdict(v, native.LIB_DIR, scalar) is None]


RUNNABLE = _runnable()
needs_library = pytest.mark.skipif(not RUNNABLE, reason="no native kernel library built (python -m edgellm.kernels.build)")


@pytest.fixture(scope="module", params=RUNNABLE or ["none"])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    out = abi.declare(ctypes.CDLL(str(native.library_path(request.param))))
    assert out.el_variant().decode() == request.param
    return out


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even (finite x)."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@needs_library
@pytest.mark.parametrize("fmt", list(QTYPES))
def test_native_dequantization_is_exact(lib: ctypes.CDLL, fmt: str) -> None:
    n, k = 48, 2 * BLOCK_WEIGHTS[fmt] if BLOCK_WEIGHTS[fmt] == 256 else 96
    blocks = random_blocks(fmt, n, k, seed=2, magnitude=0.1)
    want = gguf_values(fmt, blocks)
    stored = interleave(blocks, fmt).contiguous()
    code = EL_FORMAT_CODES[fmt]
    eye = torch.eye(k, dtype=torch.float32)
    y = torch.full((k, n), float("nan"))
    assert lib.el_gemm_f32(None, code, stored.data_ptr(), n, k, eye.data_ptr(), k, y.data_ptr()) == 0
    assert np.array_equal(y.t().numpy(), want)  # W @ I: the weights, exactly (a -0 weight sums to +0)
    out = torch.zeros(n, k, dtype=torch.int16)
    assert lib.el_dequant_bf16(None, code, stored.data_ptr(), k, 8, n, out.data_ptr()) == 0
    assert np.array_equal(out.numpy().view(np.uint16)[: n - 8], _bf16_bits(want[8:]))
    if lib.el_gemm_bf16(None, code, stored.data_ptr(), n, k, eye.data_ptr(), k, y.data_ptr()) != -2:
        bf16 = (_bf16_bits(want).astype(np.uint32) << 16).view(np.float32)
        assert np.array_equal(y.t().numpy(), bf16)
    assert lib.el_gemm_f32(None, code, stored.data_ptr(), n, k + 32, eye.data_ptr(), 1, y.data_ptr()) == -1 \
        or BLOCK_WEIGHTS[fmt] == 32  # K not a whole number of super-blocks


def _quantize_act(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d [nbx], s [nbx], q [nbx, 32]) of el_quantize_act on the float32 vector x."""
    nbx = x.numel() // 32
    raw = torch.empty(nbx, 40, dtype=torch.uint8)
    lib.el_quantize_act(x.data_ptr(), x.numel(), raw.data_ptr())
    return (raw[:, 0:4].contiguous().view(torch.float32).squeeze(-1),
            raw[:, 4:8].contiguous().view(torch.float32).squeeze(-1), raw[:, 8:].view(torch.int8))


def _reference(fmt: str, blocks: torch.Tensor, d: torch.Tensor, s: torch.Tensor, q: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [N] of W . (d q) with W the exact weights, and [N] the magnitude every term a kernel forms may have:
    sum |w x| plus the offsets it may take off per block (q4_0 / q5_0: 8 / 16 |d_w s|; q6_k / q3_k: 32 / 4 |d_w sc| sum|x|;
    q4_k / q5_k: 63 |dmin s|, q5_1: |m s|, q2_k: 15 |dmin| sum|x|, bounds of the whole min term)."""
    w = torch.from_numpy(gguf_values(fmt, blocks)).double()
    xq = (d.double().unsqueeze(-1) * q.double()).flatten()
    value = w @ xq
    magnitude = w.abs() @ xq.abs()
    n, nbx = blocks.shape[0], q.shape[0]
    if fmt in ("q4_0", "q5_0"):
        dw = torch.from_numpy(blocks.numpy().reshape(n, nbx, -1)[..., 0:2].copy().view(np.float16)).double()[..., 0]
        magnitude += ((8 if fmt == "q4_0" else 16) * dw.abs() * s.double().abs()).sum(-1)
    elif fmt == "iq4_nl":
        pass  # no offset: the signed values are multiplied as they are
    elif fmt == "q5_1":
        m = torch.from_numpy(blocks.numpy().reshape(n, nbx, -1)[..., 2:4].copy().view(np.float16)).double()[..., 0]
        magnitude += (m.abs() * s.double().abs()).sum(-1)
    elif fmt in ("q6_k", "q3_k"):
        raw = blocks.numpy().reshape(n, nbx // 8, -1)
        if fmt == "q6_k":
            dw = torch.from_numpy(raw[..., 208:210].copy().view(np.float16)).double()  # [n, sb, 1]
            sc = torch.from_numpy(raw[..., 192:208].copy().view(np.int8)).double()  # [n, sb, 16]
        else:
            dw = torch.from_numpy(raw[..., 108:110].copy().view(np.float16)).double()
            sc = torch.full(dw.shape[:-1] + (16,), 32.0, dtype=torch.float64)  # |sc| <= 32
        ax = (d.double().unsqueeze(-1) * q.double().abs()).view(nbx // 8, 16, 16).sum(-1)  # per 16 activations
        magnitude += ((32 if fmt == "q6_k" else 4) * (dw * sc).abs() * ax).sum((-1, -2))
    elif fmt == "q2_k":
        raw = blocks.numpy().reshape(n, nbx // 8, -1)
        dmin = torch.from_numpy(raw[..., 82:84].copy().view(np.float16)).double()  # [n, sb, 1]
        ax = (d.double().unsqueeze(-1) * q.double().abs()).view(nbx // 8, 256).sum(-1)  # per super-block
        magnitude += (15 * dmin[..., 0].abs() * ax).sum(-1)
    else:  # q4_k / q5_k: the min term in full: the kernel adds d s_x terms
        raw = blocks.numpy().reshape(n, nbx // 8, -1)
        dmin = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)).double()
        magnitude += (dmin.abs() * 63 * s.double().abs().view(nbx // 8, 8)).sum((-1, -2))
    return value, magnitude


# (N, K): Qwen2.5-0.5B's and Gemma 3 270M's shapes of each type (down_proj 896 x 4864, o_proj 640 x 1024,
# down 640 x 2048; Q5_0 q/gate 896 x 896, 4864 x 896) and small odd ones
SHAPES = {"q5_0": [(896, 896), (4864, 896), (8, 32), (40, 160)],
          **{f: [(896, 896), (4864, 896), (8, 32), (40, 160)] for f in ("q4_0", "iq4_nl")},
          "q5_1": [(896, 896), (8, 32), (40, 160)],
          "q4_k": [(896, 4864), (640, 1024), (8, 256), (24, 768)],
          "q6_k": [(896, 4864), (640, 2048), (8, 256), (24, 768)],
          **{f: [(896, 4864), (8, 256), (24, 768)] for f in ("q2_k", "q3_k", "q5_k")}}


@needs_library
@pytest.mark.parametrize("fmt", list(QTYPES))
@pytest.mark.parametrize("m", [1, 5])
def test_gemv_matches_float64(lib: ctypes.CDLL, fmt: str, m: int) -> None:
    for i, (n, k) in enumerate(SHAPES[fmt]):
        blocks = random_blocks(fmt, n, k, seed=10 + i, magnitude=2e-3)
        stored = interleave(blocks, fmt).contiguous()
        g = torch.Generator().manual_seed(i)
        x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k).roll(i)  # blocks of very different scales
        x[0, :32] = 0.0  # an all-zero activation block
        y = torch.full((m, n), float("nan"))
        assert lib.el_linear(None, EL_FORMAT_CODES[fmt], stored.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr()) == 0
        for row in range(m):
            d, s, q = _quantize_act(lib, x[row].contiguous())
            ref, magnitude = _reference(fmt, blocks, d, s, q)
            bound = (k // 32 + 8) * U * magnitude + 1e-30
            err = (y[row].double() - ref).abs()
            assert bool((err <= bound).all()), (fmt, n, k, row, float((err / bound).max()))


@needs_library
@pytest.mark.parametrize("fmt", list(QTYPES))
@pytest.mark.parametrize("k, m", [(512, 9), (4096, 17)])
def test_a_row_has_the_same_bits_in_any_group_pairing_and_batch(lib: ctypes.CDLL, fmt: str, k: int, m: int) -> None:
    """Each output row is the same float whichever kernel path computes it: its 8-row group alone or next to
    another (the AVX-512 q4, q8, Q4_K and Q6_K kernels take two groups at once, a tail group alone), and its
    activation row alone, among 2 or 3 (a partial tile) or among all m (tiles of rows and their tail; at K = 4096
    Q6_K / Q3_K / Q2_K take the activation sums 16 rows at a time, so 17 rows are a batch of 16 and one row alone):
    what the batched decode step's greedy-identical guarantee rests on."""
    _same_bits_in_any_pairing_and_batch(lib, fmt, k, m)


@pytest.mark.skipif("avx512" not in RUNNABLE, reason="the 16-row zmm kernels are the avx512 library's")
@pytest.mark.parametrize("pairs", ["0", "1"])
def test_q6_k_rows_have_the_same_bits_through_either_one_row_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     pairs: str) -> None:
    """EDGELLM_Q6K_PAIRS picks Q6_K's kernel for one activation row: the 16-row zmm pair, or the 8-row one (what a
    core that splits zmm operations, Zen 4, takes by default). Either way each row has the batched path's bits. (A
    copy of the library: the choice is read once per loaded library.)"""
    copy = tmp_path / f"libedgellm_avx512_pairs{pairs}.so"
    copy.write_bytes(native.library_path("avx512").read_bytes())
    monkeypatch.setenv("EDGELLM_Q6K_PAIRS", pairs)
    lib = abi.declare(ctypes.CDLL(str(copy)))
    for k, m in [(512, 9), (4096, 17)]:
        _same_bits_in_any_pairing_and_batch(lib, "q6_k", k, m)


def _same_bits_in_any_pairing_and_batch(lib: ctypes.CDLL, fmt: str, k: int, m: int) -> None:
    n = 40
    stored = interleave(random_blocks(fmt, n, k, seed=3, magnitude=2e-3), fmt).contiguous()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    code = EL_FORMAT_CODES[fmt]
    y = torch.empty(m, n)
    assert lib.el_linear(None, code, stored.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr()) == 0
    for rows in (2, 3):
        few = torch.empty(rows, n)
        assert lib.el_linear(None, code, stored.data_ptr(), n, k, x.data_ptr(), rows, few.data_ptr()) == 0
        assert torch.equal(few, y[:rows]), (fmt, rows)
    group_bytes = stored.numel() // (n // 8)
    for r in range(0, n, 8):  # each group alone (the 8-row kernels) with the whole batch
        alone = torch.empty(m, 8)
        assert lib.el_linear(None, code, stored.data_ptr() + r // 8 * group_bytes, 8, k, x.data_ptr(), m,
                             alone.data_ptr()) == 0
        assert torch.equal(alone, y[:, r:r + 8]), (fmt, r)
    for i in range(m):
        single = torch.empty(1, n)  # one activation row over all rows: the decode step's pairs
        assert lib.el_linear(None, code, stored.data_ptr(), n, k, x[i].data_ptr(), 1, single.data_ptr()) == 0
        assert torch.equal(single[0], y[i]), (fmt, i)
        for r in range(0, n, 8):
            alone = torch.empty(1, 8)
            assert lib.el_linear(None, code, stored.data_ptr() + r // 8 * group_bytes, 8, k, x[i].data_ptr(), 1,
                                 alone.data_ptr()) == 0
            assert torch.equal(alone[0], y[i, r:r + 8]), (fmt, i, r)


@needs_library
def test_gemv_refuses_a_partial_super_block(lib: ctypes.CDLL) -> None:
    x, y = torch.ones(288), torch.zeros(8)
    blob = torch.zeros(8 * BLOCK_BYTES["q4_k"] * 2, dtype=torch.uint8)
    assert lib.el_linear(None, EL_FORMAT_CODES["q4_k"], blob.data_ptr(), 8, 288, x.data_ptr(), 1, y.data_ptr()) == -1
    assert lib.el_linear(None, 77, blob.data_ptr(), 8, 256, x.data_ptr(), 1, y.data_ptr()) == -1  # unknown format
