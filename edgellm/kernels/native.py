"""Load the best native kernel library this CPU *and OS* can run, or say why there is none.

Choice, once per process (:func:`active_kernel`):

1. ``EDGELLM_KERNEL=<variant>|torch`` forces one; a forced variant that is not built or cannot run
   here raises KernelUnavailableError (one line) instead of silently falling back.
2. Otherwise the built SIMD variants are tried best first (avx512, avxvnni, avx2 / neon-dotprod,
   neon; the portable scalar one only runs when forced: it is slower than torch's kernels). A
   candidate must pass CPUID + XCR0 (x86) or HWCAP (aarch64) in the scalar library,
   and then a self-test in a child process: the child runs the library's GEMVs once on a small input
   with an exactly known answer, so an instruction the hypervisor traps (SIGILL) or a miscompiled
   library disqualifies it without harming this process. Verdicts are cached per (library sha256,
   CPU) in ``$EDGELLM_HOME/kernels/verdicts.json``.
3. No usable library (never built, no compiler, nothing passes): edgellm runs on torch kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from edgellm.errors import KernelUnavailableError
from edgellm.kernels.abi import declare
from edgellm.kernels.build import BUILD_INFO, CSRC, LIB_DIR, sources_digest, variants_for
from edgellm.paths import edgellm_home

ENV_VAR = "EDGELLM_KERNEL"
PREFILL_ENV_VAR = "EDGELLM_PREFILL_GEMM"  # "f32": the exact float32 prefill GEMM where el_gemm_i8 would run
PREFILL_GEMMS = ("int8", "f32")
TORCH = "torch"
STALE_BUILD = ("the kernel libraries were built from other C sources than this edgellm's: "
               "`python -m edgellm.kernels.build`")  # stale_build()'s answer
_PROBE_TIMEOUT_S = 60


def variant_names() -> tuple[str, ...]:
    """The variants of this architecture, best first (what EDGELLM_KERNEL accepts, besides torch)."""
    return tuple(v.name for v in variants_for())


def library_path(variant: str, lib_dir: Path = LIB_DIR) -> Path:
    return lib_dir / f"libedgellm_{variant}.so"


# ---------------------------------------------------------------------------- self-test (child process)

_PROBE_K, _PROBE_N, _PROBE_M = 96, 16, 5  # two row groups; 5 activation rows: a tile of 4 and its tail


def _interleave_groups(rows: list[bytes], header: int) -> bytes:
    """Row blocks (each row: K/32 blocks of `header` bytes of f16 fields, then quants) -> the stored
    groups of 8 rows (edgellm_kernels.h: el_block_q4x8 / el_block_q8x8)."""
    size = len(rows[0]) // (_PROBE_K // 32)
    out = bytearray()
    for g in range(0, len(rows), 8):
        for b in range(_PROBE_K // 32):
            blocks = [r[b * size : (b + 1) * size] for r in rows[g : g + 8]]
            for f in range(0, header, 2):
                out += b"".join(blk[f : f + 2] for blk in blocks)
            for t in range(0, size - header, 4):
                out += b"".join(blk[header + t : header + t + 4] for blk in blocks)
    return bytes(out)


def _probe_case() -> tuple[bytes, bytes, list[float], list[float], list[float]]:
    """q4 and q8 weights, activations that quantize exactly (block max 127, so scale 1), and the
    exact products: every value below is a small dyadic rational, so float arithmetic is exact."""
    nb = _PROBE_K // 32
    q4, q8, w4, w8 = [], [], [], []
    half = lambda v: struct.pack("<e", v)  # noqa: E731
    for r in range(_PROBE_N):
        row4, row8, blob4, blob8 = [], [], bytearray(), bytearray()
        for b in range(nb):
            d, m = 0.5 * (1 + (r + b) % 3), -float((r * 3 + b) % 5)
            q = [(r * 7 + b * 5 + j * 3) % 16 for j in range(32)]
            blob4 += half(d) + half(m) + bytes(q[j] | (q[j + 16] << 4) for j in range(16))
            row4 += [d * v + m for v in q]
            s = [((r * 11 + b * 13 + j * 29) % 255) - 127 for j in range(32)]
            blob8 += half(d) + struct.pack("32b", *s)
            row8 += [d * v for v in s]
        q4.append(bytes(blob4))
        q8.append(bytes(blob8))
        w4.append(row4)
        w8.append(row8)
    x = [float(((i * 37 + 11) % 255) - 127) for i in range(_PROBE_M * _PROBE_K)]
    for blk in range(0, len(x), 32):
        x[blk] = 127.0  # each block's max is exactly 127: scale 1, the quantized values are x itself
    return (_interleave_groups(q4, 4), _interleave_groups(q8, 2), x, [v for row in w4 for v in row],
            [v for row in w8 for v in row])


def self_test(lib: ctypes.CDLL) -> str | None:
    """Run the library's kernels on the probe case; None if every answer is right, else what was wrong."""
    q4, q8, x, w4, w8 = _probe_case()
    k, n, m = _PROBE_K, _PROBE_N, _PROBE_M
    xs = (ctypes.c_float * len(x))(*x)
    for name, fmt, blob, w in (("q4", 4, q4, w4), ("q8", 8, q8, w8)):
        ref = [sum(w[r * k + j] * x[i * k + j] for j in range(k)) for i in range(m) for r in range(n)]
        y = (ctypes.c_float * (m * n))()
        if lib.el_linear(None, fmt, blob, n, k, xs, m, y) != 0:
            return f"el_linear({name}) failed"
        bad = [(i, a, b) for i, (a, b) in enumerate(zip(y, ref)) if abs(a - b) > 1e-3 * (1 + abs(b))]
        if bad:
            return f"{name} GEMV gave {bad[0][1]} for {bad[0][2]}"
    return None


def probe_main(path: str) -> int:
    """Child-process entry: exit 0 if the library at ``path`` passes its self-test, else print why."""
    lib = declare(ctypes.CDLL(path))
    if (why := self_test(lib)) is not None:
        print(why)
        return 1
    return 0


def _run_probe(path: Path) -> str | None:
    """Self-test ``path`` in a child process; None if it passed, else a one-line reason."""
    code = "import sys; from edgellm.kernels.native import probe_main; sys.exit(probe_main(sys.argv[1]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"self-test did not finish in {_PROBE_TIMEOUT_S} s"
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:
        return f"self-test killed by {signal.Signals(-proc.returncode).name} (instruction not allowed here)"
    last = (proc.stdout.strip() or proc.stderr.strip() or "?").splitlines()[-1]
    return f"self-test failed: {last}"[:300]


# ---------------------------------------------------------------------------- verdict cache


def cpu_key() -> str:
    """This CPU: model name plus a digest of its feature flags (a VM may hide some of a model's)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or fields.get("cpu part") or platform.processor() or platform.machine()
    flags = fields.get("flags") or fields.get("features") or ""
    return f"{model} [{hashlib.sha256(flags.encode()).hexdigest()[:12]}]"


def _cache_file() -> Path:
    return edgellm_home() / "kernels" / "verdicts.json"


def _read_cache() -> dict[str, str]:
    try:
        data = json.loads(_cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict[str, str]) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".verdicts.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable home only costs a probe next time


def verdict(variant: str, lib_dir: Path = LIB_DIR, scalar: ctypes.CDLL | None = None) -> str | None:
    """None if ``variant`` can run here, else why not (cached per library hash and CPU)."""
    path = library_path(variant, lib_dir)
    if not path.is_file():
        return f"not built ({_build_note(variant, lib_dir)})"
    if scalar is not None and not scalar.el_cpu_allows(variant.encode()):
        return "this CPU or OS does not allow it (CPUID/XCR0/HWCAP)"
    cpu = cpu_key()
    key = f"{variant}:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}:{cpu}"
    cache = _read_cache()
    if key in cache:
        return cache[key] or None
    why = _run_probe(path)
    # a rebuilt library replaces its predecessor's verdict on this CPU
    cache = {k: v for k, v in cache.items() if not (k.startswith(f"{variant}:") and k.endswith(f":{cpu}"))}
    cache[key] = why or ""
    _write_cache(cache)
    return why


def _build_note(variant: str, lib_dir: Path) -> str:
    try:
        info = json.loads((lib_dir / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return "no build ran: `python -m edgellm.kernels.build`"
    return str(info.get("variants", {}).get(variant, "not a variant of this build"))


# ---------------------------------------------------------------------------- selection


def stale_build(lib_dir: Path = LIB_DIR) -> str | None:
    """Why the libraries in ``lib_dir`` must not be loaded by this edgellm, or None: a build from other C
    sources (an updated checkout not rebuilt) may lay out the decode step's model description otherwise
    than decoder.py does, and would misread it. A folder without build info is judged variant by variant."""
    try:
        built = json.loads((lib_dir / BUILD_INFO).read_text()).get("sources_sha256")
    except (OSError, ValueError, AttributeError):
        return None
    if built is None or not CSRC.is_dir() or built == sources_digest():
        return None
    return STALE_BUILD


@functools.cache
def _scalar_library(lib_dir: Path) -> ctypes.CDLL | None:
    """The scalar library (runs on any CPU of the architecture): where CPU features are asked."""
    path = library_path("scalar", lib_dir)
    try:
        return declare(ctypes.CDLL(str(path))) if path.is_file() else None
    except OSError:
        return None


def choose(lib_dir: Path = LIB_DIR, forced: str | None = None) -> tuple[str, str]:
    """(variant or "torch", why) for this machine; raises KernelUnavailableError for a bad forced one."""
    names = variant_names()
    if forced == TORCH:
        return TORCH, f"{ENV_VAR}=torch"
    if stale := stale_build(lib_dir):
        if forced:
            raise KernelUnavailableError(f"{ENV_VAR}={forced} cannot run here: {stale}")
        return TORCH, stale
    scalar = _scalar_library(lib_dir)
    if forced:
        if forced not in names:
            raise KernelUnavailableError(
                f"{ENV_VAR}={forced} is not a kernel of this machine ({platform.machine()}); "
                f"choose one of: {', '.join((*names, TORCH))}"
            )
        if why := verdict(forced, lib_dir, scalar):
            raise KernelUnavailableError(f"{ENV_VAR}={forced} cannot run here: {why}")
        return forced, f"forced by {ENV_VAR}={forced}"
    rejected = []
    for name in names:
        if name == "scalar":  # portable C: ~10x slower than torch's packed kernels, so only when forced
            rejected.append("scalar: used only when forced (slower than torch's kernels)")
            continue
        why = verdict(name, lib_dir, scalar)
        if why is None:
            note = f" ({'; '.join(rejected)})" if rejected else ""
            return name, f"best variant this CPU and OS run{note}"
        rejected.append(f"{name}: {why}")
    return TORCH, "no native kernel library usable: " + "; ".join(rejected)


@functools.cache
def active_kernel() -> tuple[str, str]:
    """(name, why): the kernel this process uses for quantized matmuls ("torch" when not native)."""
    prefill = os.environ.get(PREFILL_ENV_VAR)
    if prefill and prefill not in PREFILL_GEMMS:
        raise KernelUnavailableError(f"{PREFILL_ENV_VAR}={prefill} is not a prefill GEMM; choose one of: "
                                     f"{', '.join(PREFILL_GEMMS)}")
    return choose(LIB_DIR, os.environ.get(ENV_VAR, "").strip().lower() or None)


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The active variant's library with its signatures declared, or None on the torch path."""
    name, _ = active_kernel()
    if name == TORCH:
        return None
    return declare(ctypes.CDLL(str(library_path(name))))


@functools.cache
def has_gemm_bf16() -> bool:
    """Whether the active library has the AVX512-BF16 prefill GEMM on this CPU and OS (it answers -2 if not)."""
    lib = load_library()
    return lib is not None and lib.el_gemm_bf16(None, 4, None, 8, 32, None, 0, None) == 0


@functools.cache
def prefill_matmul() -> str | None:
    """The matmul the active library's native prefill (el_decoder_prefill*) multiplies with on this CPU and OS:
    "bf16" (el_gemm_bf16, AVX512-BF16), "int8" (el_gemm_i8, the x86 variants, with el_gemm_f32 for the formats it does
    not take), "f32" (el_gemm_f32, the NEON variants), or None where that library has no
    native prefill (the scalar variant, or the torch path): prompts then go token by token or through torch."""
    lib = load_library()
    if lib is None:
        return None
    name = lib.el_prefill_matmul()
    return name.decode() if name else None


@functools.cache
def pool(nthreads: int, spin_us: int | None = None) -> int | None:
    """A thread pool of the active library with ``nthreads`` threads (None: run on the caller only), whose idle
    workers spin ``spin_us`` microseconds before they sleep (None: the library's default, for decode steps; 0
    for prefill's matmuls, between which torch's threads run other ops on the same cores)."""
    lib = load_library()
    if lib is None or nthreads <= 1:
        return None
    return (lib.el_pool_create(nthreads) if spin_us is None else lib.el_pool_create_spin(nthreads, spin_us)) or None
