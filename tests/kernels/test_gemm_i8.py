"""el_gemm_i8, the x86 libraries' prefill matmul where AVX512-BF16 is missing: activation rows quantized as the decode
step's (el_quantize_act), integer products, one float multiply-add per block of 32.

Against float64 products of the quantized activations (d q) and gguf-py-exact weights (dequantize): the integer sums
are exact, so what is left is float32 rounding of the per-block scale products and the running sum; against el_linear
(the decode step's GEMM over the same quantized activations) within the same bound; the same bits on a pool and for
any split of M; -2 (nothing written) for the formats it does not take and in non-x86 libraries; -1 for bad shapes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from edgellm.quant.formats import EL_FORMAT_CODES, dequantize, interleave
from tests.kernels.test_kernels import RUNNABLE, lib  # noqa: F401  (the per-variant library fixture)
from tests.kernels.test_kernels import random_blocks as own_blocks
from tests.quant.test_gguf_blocks import random_blocks as gguf_blocks

TAKEN = ("q4", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
REFUSED = ("q8", "q2_k", "q3_k", "iq4_nl")
Q8A = np.dtype([("d", "<f4"), ("s", "<f4"), ("qs", "i1", 32)])  # el_block_q8a
# (N, K, M): one group; an odd number of groups (a tile of one); M past an item (64 rows); K past a chunk (32 blocks)
SHAPES = ((8, 256, 1), (24, 256, 65), (48, 1280, 3), (16, 512, 130))


def _x86(lib: ctypes.CDLL) -> bool:
    return lib.el_variant().decode() in ("avx512", "avxvnni", "avx2")


def _weights(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = own_blocks(fmt, n, k, seed=seed) if fmt in ("q4", "q8") else gguf_blocks(fmt, n, k, seed=seed)
    stored = interleave(blocks, fmt)
    return stored, dequantize({"qweight": stored}, fmt).double()


def _quantized(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """The activation rows as the kernel sees them: d * q per block of 32, in float64."""
    m, k = x.shape
    blocks = np.zeros((m, k // 32), Q8A)
    for i in range(m):
        row = x[i].contiguous()
        lib.el_quantize_act(row.data_ptr(), k, blocks[i].ctypes.data)
    return torch.from_numpy(blocks["d"].astype(np.float64)[..., None] * blocks["qs"].astype(np.float64)).reshape(m, k)


def _run(lib: ctypes.CDLL, fn: str, fmt: str, stored: torch.Tensor, n: int, k: int, x: torch.Tensor, pool=None
         ) -> tuple[int, torch.Tensor]:
    y = torch.full((x.shape[0], n), float("nan"))
    rc = getattr(lib, fn)(pool, EL_FORMAT_CODES[fmt], stored.data_ptr(), n, k, x.data_ptr(), x.shape[0], y.data_ptr())
    return rc, y


@pytest.mark.parametrize("fmt", TAKEN)
def test_gemm_i8_is_the_product_of_the_quantized_activations(lib: ctypes.CDLL, fmt: str) -> None:  # noqa: F811
    """|y - ref| <= 2^-20 sum_k |x^_k w_k| + 2^-20 max|ref| (float32 rounding of ~3 operations per block of 32 and
    of the chain over K/32 blocks; a wrong scale, offset or quant is off by 1e-2 and more), and within the same of
    el_linear; the same bits on a 3-thread pool and row by row."""
    if not _x86(lib):
        pytest.skip(f"el_gemm_i8 is x86-only; the {lib.el_variant().decode()} library answers -2 (test below)")
    pool = lib.el_pool_create(3)
    try:
        for n, k, m in SHAPES:
            stored, w = _weights(fmt, n, k, seed=n + k + m)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.logspace(-1, 1, k)
            xq = _quantized(lib, x)
            ref = xq @ w.T
            bound = 2.0**-20 * ((xq.abs() @ w.abs().T) + ref.abs().max())
            rc, y = _run(lib, "el_gemm_i8", fmt, stored, n, k, x)
            assert rc == 0 and ((y.double() - ref).abs() <= bound).all(), (fmt, n, k, m, (y.double() - ref).abs().max())
            rc, y_lin = _run(lib, "el_linear", fmt, stored, n, k, x)
            assert rc == 0 and ((y.double() - y_lin.double()).abs() <= 2 * bound).all(), (fmt, n, k, m)
            rc, y_pool = _run(lib, "el_gemm_i8", fmt, stored, n, k, x, pool)
            assert rc == 0 and torch.equal(y_pool, y)
            for i in (0, m - 1):
                rc, y1 = _run(lib, "el_gemm_i8", fmt, stored, n, k, x[i:i + 1].contiguous(), pool)
                assert rc == 0 and torch.equal(y1[0], y[i])
    finally:
        lib.el_pool_destroy(pool)


def test_gemm_i8_refuses_what_it_does_not_take(lib: ctypes.CDLL) -> None:  # noqa: F811
    """-2 and nothing written for q8, q2_k, q3_k, iq4_nl (and, outside x86, for every format); -1 for a row count
    not a multiple of 8, K not a whole number of blocks, no rows."""
    n, k = 16, 256
    x = torch.randn(2, k)
    for fmt in (*REFUSED, *(() if _x86(lib) else TAKEN)):
        stored, _ = _weights(fmt, n, k, seed=1)
        rc, y = _run(lib, "el_gemm_i8", fmt, stored, n, k, x)
        assert rc == -2 and torch.isnan(y).all(), fmt
    stored, _ = _weights("q4_k", n, k, seed=2)
    for nn, kk in ((12, 256), (16, 288), (0, 256)):
        rc, _ = _run(lib, "el_gemm_i8", "q4_k", stored, nn, kk, torch.randn(1, kk))
        assert rc == -1, (nn, kk)


def test_the_x86_libraries_prefill_with_it() -> None:
    """Where AVX512-BF16 is missing, el_prefill_matmul names the int8 GEMM in every x86 library that runs here."""
    for variant in RUNNABLE:
        if variant not in ("avx512", "avxvnni", "avx2"):
            continue
        from edgellm.kernels import abi, native

        one = abi.declare(ctypes.CDLL(str(native.library_path(variant))))
        bf16 = variant == "avx512" and one.el_cpu_allows(b"avx512bf16") == 1
        assert one.el_prefill_matmul().decode() == ("bf16" if bf16 else "int8"), variant
