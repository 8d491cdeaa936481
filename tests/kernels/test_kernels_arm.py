"""The aarch64 kernels (NEON, NEON dotprod, scalar), cross-compiled and run under qemu-user.

Each variant is built from every .c file under csrc/ with build.py's aarch64 flags plus a small driver
(tests/data/kernel_driver.c), run under ``qemu-aarch64`` on the same inputs as the x86 tests, and
held to the same float64 bounds (see tests/test_kernels.py). Needs Debian's gcc-aarch64-linux-gnu
and qemu-user; skipped with that reason when they are absent.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.kernels import build
from tests.support.arm_cross import ARM_VARIANTS, CROSS_CC, QEMU, cross_compile, needs_cross
from edgellm.quant.formats import EL_FORMAT_CODES, SOURCE_ONLY as GGUF_BLOCKS, dequantize, interleave
from tests.quant.test_gguf_blocks import gguf_values, random_blocks as gguf_random_blocks
from tests.kernels.test_kernels import QK, U, exact_sum, random_blocks

DRIVER = Path(__file__).parents[1] / "data" / "kernel_driver.c"
SHAPES = [(40, 160), (192, 576), (128, 896), (64, 4864)]

pytestmark = needs_cross


@pytest.fixture(scope="module")
def drivers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return cross_compile(DRIVER, tmp_path_factory.mktemp("arm"))


def run_driver(exe: Path, fmt: str, blocks: torch.Tensor, x: torch.Tensor, cpu: str = "max", ask: str = "scalar"):
    """Run the driver on row blocks `blocks` (sent interleaved, as the kernels read them)."""
    n, k = blocks.shape[0], x.numel()
    stdin = struct.pack("<3i", int(fmt[1:]), n, k) + interleave(blocks, fmt).numpy().tobytes() + x.numpy().tobytes()
    proc = subprocess.run([QEMU, "-cpu", cpu, str(exe), ask], input=stdin, capture_output=True, timeout=600)
    if proc.returncode:
        return proc.returncode, None
    out = proc.stdout
    name = out[:16].rstrip(b"\0").decode()
    (allowed,) = struct.unpack("<i", out[16:20])
    nb = k // QK
    raw = torch.frombuffer(bytearray(out[20 : 20 + nb * 40]), dtype=torch.uint8).view(nb, 40)
    y = torch.frombuffer(bytearray(out[20 + nb * 40 :]), dtype=torch.float32)
    return 0, (name, allowed, raw, y)


@pytest.mark.parametrize("variant", list(ARM_VARIANTS))
@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_arm_variant_matches_float64(drivers: dict[str, Path], variant: str, fmt: str) -> None:
    for n, k in SHAPES:
        blocks = random_blocks(fmt, n, k, seed=n * k)
        x = torch.randn(k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-1, 1, k)
        x[32:64] = 0.0  # a zero activation block
        rc, result = run_driver(drivers[variant], fmt, blocks, x)
        assert rc == 0
        name, _, raw, y = result
        assert name == variant
        d = raw[:, 0:4].contiguous().view(torch.float32).squeeze(-1)
        s = raw[:, 4:8].contiguous().view(torch.float32).squeeze(-1)
        q = raw[:, 8:].view(torch.int8)
        e = x.double() - (d.double().unsqueeze(-1) * q.double()).flatten()
        assert torch.all(e.abs().view(-1, QK) <= d.double().unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-45)
        ref, magnitude = exact_sum(fmt, blocks, d, s, q)
        err = (y.double() - ref).abs()
        assert torch.all(err <= (k // QK + 4) * U * magnitude + 1e-30)
        w = dequantize({"qweight": interleave(blocks, fmt)}, fmt).double()
        assert torch.all((y.double() - w @ x.double()).abs() <= (k // QK + 4) * U * magnitude + w.abs() @ e.abs())


def test_arm_hwcap_check_and_trap(drivers: dict[str, Path]) -> None:
    """HWCAP says dotprod on a CPU that has it and not on one that lacks it; there, sdot traps."""
    blocks, x = random_blocks("q8", 8, 64, seed=1), torch.randn(64)
    assert run_driver(drivers["scalar"], "q8", blocks, x, "max", "neon-dotprod")[1][1] == 1
    assert run_driver(drivers["scalar"], "q8", blocks, x, "cortex-a53", "neon-dotprod")[1][1] == 0
    assert run_driver(drivers["scalar"], "q8", blocks, x, "cortex-a53", "neon")[1][1] == 1
    rc, _ = run_driver(drivers["neon-dotprod"], "q8", blocks, x, "cortex-a53")
    assert rc != 0  # SIGILL: what the loader's child-process self-test catches
    assert run_driver(drivers["neon"], "q8", blocks, x, "cortex-a53")[0] == 0


@pytest.mark.parametrize("variant", sorted(ARM_VARIANTS))
def test_arm_sources_compile_without_warnings(variant: str, tmp_path: Path) -> None:
    """Every kernel source (the decode step's int8 KV-cache loads use NEON intrinsics) is warning-free."""
    for source in build.sources():
        cmd = [CROSS_CC, "-O3", "-std=c11", "-Wall", "-Wextra", "-Werror", *ARM_VARIANTS[variant].flags,
               f"-I{build.CSRC}", "-c", str(source), "-o", str(tmp_path / "out.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{source.name}: {proc.stderr}"


@pytest.mark.parametrize("variant", sorted(ARM_VARIANTS))
def test_arm_int8_and_half_widening(variant: str, tmp_path: Path) -> None:
    """vec.h's int8 and half -> float loads (the q8 and f16 KV caches' decode path) on every int8 value and
    every half bit pattern, under qemu."""
    exe = tmp_path / "vec"
    flags = ARM_VARIANTS[variant].flags
    cmd = [CROSS_CC, "-O3", "-static", "-std=c11", *flags, f"-I{build.CSRC}", "-o", str(exe),
           str(DRIVER.with_name("vec_driver.c")), *map(str, build.sources()), "-pthread", "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    run = subprocess.run([QEMU, "-cpu", "max", str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == ("ok generic" if "-DEL_SCALAR" in flags else "ok neon")


@pytest.mark.parametrize("variant", sorted(ARM_VARIANTS))
@pytest.mark.parametrize("fmt", ["q4", "q8", *GGUF_BLOCKS])
def test_arm_gemm_f32_matches_float64(variant: str, fmt: str, tmp_path: Path) -> None:
    """el_gemm_f32 (the native prefill's GEMM on ARM) against float64 products of the exactly dequantized weights:
    within K 2^-23 sum|x w| (one float32 multiply-add chain per output), the same bits on a 3-thread pool; the NEON
    libraries prefill with it (el_prefill_matmul "f32"), the scalar one has no native prefill."""
    exe = tmp_path / "gemm"
    cmd = [CROSS_CC, "-O3", "-static", "-pthread", "-std=c11", *ARM_VARIANTS[variant].flags, f"-I{build.CSRC}",
           "-o", str(exe), str(DRIVER.with_name("gemm_driver.c")), *map(str, build.sources()), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    shapes = ((40, 512, 13), (24, 768, 7)) if fmt in GGUF_BLOCKS else ((40, 160, 13), (24, 800, 7))
    for n, k, m in shapes:
        blocks = gguf_random_blocks(fmt, n, k, seed=n * k) if fmt in GGUF_BLOCKS else random_blocks(fmt, n, k, seed=n * k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.logspace(-1, 1, k)
        stdin = (struct.pack("<4i", EL_FORMAT_CODES[fmt], n, k, m) + interleave(blocks, fmt).numpy().tobytes()
                 + x.numpy().tobytes())
        done = subprocess.run([QEMU, "-cpu", "max", str(exe)], input=stdin, capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr
        matmul = done.stdout[:16].rstrip(b"\0").decode()
        assert matmul == ("" if variant == "scalar" else "f32")
        y = torch.frombuffer(bytearray(done.stdout[16:]), dtype=torch.float32).view(2, m, n)
        w = dequantize({"qweight": interleave(blocks, fmt)}, fmt).double()
        ref, bound = x.double() @ w.T, k * 2.0**-23 * (x.double().abs() @ w.abs().T)
        assert ((y[0].double() - ref).abs() <= bound).all()
        assert torch.equal(y[0], y[1])
    if fmt in GGUF_BLOCKS:  # times the identity: the panels hold gguf-py's values bit for bit (W @ I = W exactly)
        n, k = 16, 256
        blocks = gguf_random_blocks(fmt, n, k, seed=5, magnitude=0.1)
        stdin = (struct.pack("<4i", EL_FORMAT_CODES[fmt], n, k, k) + interleave(blocks, fmt).numpy().tobytes()
                 + torch.eye(k).numpy().tobytes())
        done = subprocess.run([QEMU, "-cpu", "max", str(exe)], input=stdin, capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr
        y = torch.frombuffer(bytearray(done.stdout[16:]), dtype=torch.float32).view(2, k, n)
        assert np.array_equal(y[0].t().numpy(), gguf_values(fmt, blocks))
