"""Compile the native kernels: one shared library per instruction-set variant this compiler supports.

Every ``.c`` file under ``csrc/`` (``ops/``, ``matmul/``, ``decoder/``; ``arch/`` holds only headers and the
per-ISA ``.inc`` bodies those files include) goes into each library, compiled with that variant's target flags
and ``-I csrc``, as ``_lib/libedgellm_<variant>.so``. Which variant runs is decided later, at load time
(:mod:`edgellm.kernels.native`), from what the CPU and the OS allow.

Runs from the install (``setup.py``'s build hook, which never fails the install) and on demand::

    python -m edgellm.kernels.build [--cc CC] [--out DIR] [--variant NAME ...]

Standard library only: the install hook imports this file by path, before any dependency exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_DIR = Path(__file__).resolve().parent / "_lib"
BUILD_INFO = "build.json"
BASE_FLAGS = ("-O3", "-fPIC", "-pthread", "-shared", "-std=c11", "-fvisibility=default")


@dataclass(frozen=True)
class Variant:
    """One instruction-set variant: its name (as ``el_variant()`` returns it) and compiler flags."""

    name: str
    flags: tuple[str, ...]


_X86_VARIANTS = (
    Variant("avx512", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c")),
    Variant("avxvnni", ("-mavxvnni", "-mavx2", "-mfma", "-mf16c")),
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c")),
)
_ARM_VARIANTS = (
    Variant("neon-dotprod", ("-march=armv8.2-a+dotprod",)),
    Variant("neon", ("-march=armv8-a",)),
)
SCALAR = Variant("scalar", ("-DEL_SCALAR",))


def variants_for(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants worth building for ``machine`` (``platform.machine()`` by default), best first."""
    m = (machine or platform.machine()).lower()
    if m in ("x86_64", "amd64", "x64"):
        return (*_X86_VARIANTS, SCALAR)
    if m in ("aarch64", "arm64"):
        return (*_ARM_VARIANTS, SCALAR)
    return (SCALAR,)


def find_compiler() -> str | None:
    """``$CC`` if set, else the first of cc, gcc, clang on PATH; None if there is none."""
    if cc := os.environ.get("CC", "").strip():
        return cc
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def sources(csrc: Path = CSRC) -> list[Path]:
    """Every C translation unit of the library (each ``.c`` under ``csrc``), sorted: the build is deterministic."""
    return sorted(csrc.rglob("*.c"))


def sources_digest(csrc: Path = CSRC) -> str:
    """sha256 over the paths (relative to ``csrc``) and contents of every .c, .h and .inc file under it."""
    h = hashlib.sha256()
    for p in sorted(q for q in csrc.rglob("*") if q.suffix in (".c", ".h", ".inc")):
        h.update(p.relative_to(csrc).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def compile_library(
    cc: str, srcs: list[Path], out: Path, flags: tuple[str, ...], extra: tuple[str, ...] = (), include: Path = CSRC
) -> None:
    """Compile ``srcs`` into the shared library ``out`` (written to a temp name, then renamed); ``include`` is the
    source root their ``#include "..."`` paths are relative to.

    Raises RuntimeError with the compiler's first error line on failure.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    cmd = [cc, *BASE_FLAGS, *flags, *extra, f"-I{include}", "-o", tmp,
           *map(str, srcs), "-lm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines() or ["?"]
            raise RuntimeError(f"{cc} failed: {lines[0].strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(
    out_dir: Path = LIB_DIR, cc: str | None = None, only: list[str] | None = None, quiet: bool = False
) -> dict[str, str]:
    """Build every variant this compiler supports into ``out_dir``; returns {variant: "ok" | why not}.

    A variant the compiler rejects (e.g. an old gcc without ``-mavxvnni``) is skipped, not fatal.
    Raises RuntimeError when there is no compiler or nothing could be built.
    """
    cc = cc or find_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    srcs = sources()
    if not srcs:
        raise RuntimeError(f"no C sources in {CSRC}")
    todo = [v for v in variants_for() if only is None or v.name in only]
    result: dict[str, str] = {}
    for v in todo:
        try:
            compile_library(cc, srcs, out_dir / f"libedgellm_{v.name}.so", v.flags)
            result[v.name] = "ok"
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            result[v.name] = str(e)
        if not quiet:
            print(f"edgellm kernels: {v.name}: {result[v.name]}", file=sys.stderr)
    info = {"compiler": cc, "sources_sha256": sources_digest(), "machine": platform.machine(), "variants": result}
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")
    if "ok" not in result.values():
        raise RuntimeError(f"no kernel variant compiled ({'; '.join(f'{k}: {v}' for k, v in result.items())})")
    return result


def build_quietly(out_dir: Path = LIB_DIR) -> None:
    """The install hook: build, and on any failure print one warning (edgellm then runs on torch)."""
    try:
        build(out_dir, quiet=True)
    except Exception as e:  # noqa: BLE001 - an install must never fail because of the kernels
        print(f"edgellm: warning: native kernels not built ({e}); edgellm will use its torch kernels",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgellm.kernels.build", description=__doc__.split("\n")[0])
    ap.add_argument("--cc", help="C compiler (default: $CC, else cc/gcc/clang)")
    ap.add_argument("--out", type=Path, default=LIB_DIR, help=f"output folder (default: {LIB_DIR})")
    ap.add_argument("--variant", action="append", help="build only this variant (repeatable)")
    args = ap.parse_args(argv)
    try:
        build(args.out, args.cc, args.variant)
    except RuntimeError as e:
        print(f"edgellm: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
