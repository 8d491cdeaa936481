"""The GGUF block kernels (q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k) on aarch64 (NEON, NEON dotprod, scalar),
cross-compiled and run under qemu-user as tests/test_kernels_arm.py runs q4 / q8.

A driver (tests/data/gguf_driver.c) reads random valid GGUF blocks (interleaved as stored) and activations, and
writes el_linear's outputs and el_block_row_f32's rows: the rows must be gguf-py's ``dequantize`` bit for bit, the
outputs within tests/test_gguf_blocks.py's float64 bound of the same quantized operands. Needs Debian's
gcc-aarch64-linux-gnu and qemu-user; skipped with that reason when they are absent.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.arm_cross import ARM_VARIANTS, QEMU, cross_compile, needs_cross
from edgellm.quant.formats import BLOCK_WEIGHTS, EL_FORMAT_CODES, interleave
from tests.quant.test_gguf_blocks import QTYPES, U, _reference, gguf_values, random_blocks

DRIVER = Path(__file__).parents[1] / "data" / "gguf_driver.c"

pytestmark = needs_cross


@pytest.fixture(scope="module")
def drivers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return cross_compile(DRIVER, tmp_path_factory.mktemp("arm_gguf"))


@pytest.mark.parametrize("variant", list(ARM_VARIANTS))
@pytest.mark.parametrize("fmt", list(QTYPES))
def test_arm_gguf_kernels_match_gguf_py_and_float64(drivers: dict[str, Path], variant: str, fmt: str) -> None:
    bk = BLOCK_WEIGHTS[fmt]
    for i, (n, k, m) in enumerate(((8, bk, 1), (24, 3 * bk if bk == 256 else 160, 2), (16, 4864 if bk == 256 else 896, 1))):
        blocks = random_blocks(fmt, n, k, seed=20 + i, magnitude=2e-3)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i)) * torch.logspace(-2, 1, k).roll(i)
        x[0, :32] = 0.0  # an all-zero activation block
        stdin = (struct.pack("<4i", EL_FORMAT_CODES[fmt], n, k, m) + interleave(blocks, fmt).numpy().tobytes()
                 + x.numpy().tobytes())
        proc = subprocess.run([QEMU, "-cpu", "max", str(drivers[variant])], input=stdin, capture_output=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr
        out, nbx = proc.stdout, k // 32
        assert out[:16].rstrip(b"\0").decode() == variant
        assert struct.unpack("<i", out[16:20])[0] == 0
        at = 20 + m * nbx * 40
        acts = torch.frombuffer(bytearray(out[20:at]), dtype=torch.uint8).view(m, nbx, 40)
        y = torch.frombuffer(bytearray(out[at : at + 4 * m * n]), dtype=torch.float32).view(m, n)
        rows = np.frombuffer(out[at + 4 * m * n :], dtype=np.float32).reshape(n, k)
        assert np.array_equal(rows.view(np.uint32), gguf_values(fmt, blocks).view(np.uint32))
        for row in range(m):
            raw = acts[row]
            d = raw[:, 0:4].contiguous().view(torch.float32).squeeze(-1)
            s = raw[:, 4:8].contiguous().view(torch.float32).squeeze(-1)
            ref, magnitude = _reference(fmt, blocks, d, s, raw[:, 8:].view(torch.int8))
            bound = (nbx + 8) * U * magnitude + 1e-30
            err = (y[row].double() - ref).abs()
            assert bool((err <= bound).all()), (variant, fmt, n, k, row, float((err / bound).max()))
