"""Cross-compiling a C driver with the kernel library for aarch64 and running it under qemu-user: the NEON kernels'
tests (tests/kernels/test_kernels_arm*.py), skipped with the reason where the tools are not installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from edgellm.kernels import build

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
ARM_VARIANTS = {v.name: v for v in build.variants_for("aarch64")}
needs_cross = pytest.mark.skipif(
    shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None,
    reason=f"needs {CROSS_CC} and {QEMU} (apt-get install gcc-aarch64-linux-gnu qemu-user)",
)


def cross_compile(driver: Path, out: Path) -> dict[str, Path]:
    """`driver` linked statically with the whole library, one executable per aarch64 variant, by name."""
    exes = {}
    for name, variant in ARM_VARIANTS.items():
        exe = out / f"driver-{name}"
        cmd = [CROSS_CC, "-O3", "-static", "-pthread", "-std=c11", *variant.flags, f"-I{build.CSRC}",
               "-o", str(exe), str(driver), *map(str, build.sources()), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        exes[name] = exe
    return exes
