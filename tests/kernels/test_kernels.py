"""Native GEMV kernels: every variant this machine runs, forced, against float64 references.

Numbers proved here, per variant and per shape of both catalog models (and N, K not multiples of 64):
* activation quantization: |x - d * q| <= d / 2 per element (d = block max / 127), s = d * sum(q);
* the kernel vs the float64 value of the same quantized operands:
  |y - ref| <= (nb + 4) * 2^-24 * sum over blocks of (|d_w d_x| sum|q_w q_x| + |m_w s_x|)
  (float32 rounding of at most 2 nb + 8 partial products, summed in any order); for q8 the sum also
  counts 128 |d_w d_x| sum|q_x|, as a kernel may offset the quants by 128 (the unsigned operand of
  vpdpbusd) and take 128 d_w s_x off again;
* the kernel vs float64 W @ x with x not quantized: the above plus sum_k |w_k| |x_k - d q_k|.
Both bounds are derived from the quantization, not tuned: they hold for any correct implementation.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgellm.errors import KernelUnavailableError
from edgellm.kernels import abi, build, native
from edgellm.quant import dispatch
from edgellm.quant.formats import BLOCK_BYTES, ROW_GROUP, dequantize, interleave, q4_fields, q8_fields, quantize, row_blocks

QK = 32
U = 2.0**-24  # float32 unit roundoff

# (N, K) of every matmul weight: SmolLM2-135M (hidden 576, 3 kv heads of 64, mlp 1536, vocab 49152)
# and Qwen2.5-0.5B (hidden 896, 2 kv heads of 64, mlp 4864, vocab 151936).
SMOLLM2_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
QWEN_SHAPES = [(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896)]
ODD_SHAPES = [(8, 32), (56, 96), (40, 160), (1000, 224)]  # N and K not multiples of 64 (N of 8: row groups)
REF_ROWS = 1 << 21  # weights checked against float64 per shape: larger shapes check row windows


def _runnable() -> list[str]:
    scalar = native._scalar_library(native.LIB_DIR)
    return [v for v in native.variant_names() if native.verdict(v, native.LIB_DIR, scalar) is None]


RUNNABLE = _runnable()
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="no native kernel library built (python -m edgellm.kernels.build)")


@pytest.fixture(scope="module", params=RUNNABLE or ["none"])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    out = abi.declare(ctypes.CDLL(str(native.library_path(request.param))))
    assert out.el_variant().decode() == request.param
    return out


# ---------------------------------------------------------------------------- helpers


def _f16_bytes(h: torch.Tensor) -> torch.Tensor:
    return h.contiguous().view(torch.uint8).view(*h.shape, 2)


def random_blocks(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Random valid row blocks (cheap for the 151936-row vocab), scales of varied magnitude; the kernels
    take them interleaved (formats.interleave)."""
    g = torch.Generator().manual_seed(seed)
    nb = k // QK
    d = (torch.rand(n, nb, generator=g) * 0.02 * torch.logspace(-2, 1, nb)).half()
    if fmt == "q4":
        m = (-torch.rand(n, nb, generator=g) * 0.1).half()
        qs = torch.randint(0, 256, (n, nb, 16), generator=g, dtype=torch.uint8)
        blocks = torch.cat((_f16_bytes(d), _f16_bytes(m), qs), dim=-1)
    else:
        qs = torch.randint(-127, 128, (n, nb, 32), generator=g, dtype=torch.int8).view(torch.uint8)
        blocks = torch.cat((_f16_bytes(d), qs), dim=-1)
    return blocks.view(n, nb * BLOCK_BYTES[fmt])


def quantize_act(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw el_block_q8a bytes, d [nb], s [nb], q [nb, 32]) of the float32 vector x."""
    nb = x.numel() // QK
    raw = torch.empty(nb, 40, dtype=torch.uint8)
    lib.el_quantize_act(x.data_ptr(), x.numel(), raw.data_ptr())
    d = raw[:, 0:4].contiguous().view(torch.float32).squeeze(-1)
    s = raw[:, 4:8].contiguous().view(torch.float32).squeeze(-1)
    return raw, d, s, raw[:, 8:].view(torch.int8)


def exact_sum(
    fmt: str, blocks: torch.Tensor, d: torch.Tensor, s: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [N] value of sum_b d_w d_x sum(q_w q_x) (+ m_w s_x for q4), and [N] the same sum with
    every product in absolute value (what float rounding error is proportional to)."""
    qx = q.double()
    if fmt == "q4":
        dw, mw, qw = q4_fields(blocks)
        mterm = mw.double() * s.double()
    else:
        dw, qw = q8_fields(blocks)
        mterm = 128.0 * (dw.double() * d.double()).abs() * qx.abs().sum(-1)  # in the magnitude only, below
    qw = qw.double()
    scale = dw.double() * d.double()
    value = (scale * (qw * qx).sum(-1) + (mterm if fmt == "q4" else 0.0)).sum(-1)
    magnitude = (scale.abs() * (qw * qx).abs().sum(-1) + mterm.abs()).sum(-1)
    return value, magnitude


def windows(n: int, k: int) -> list[tuple[int, int]]:
    """Row ranges to check (whole row groups): all rows of small matrices; first, middle and last rows
    of large ones."""
    if n * k <= REF_ROWS:
        return [(0, n)]
    w = max(ROW_GROUP, REF_ROWS // k // 3 // ROW_GROUP * ROW_GROUP)
    mid = n // 2 // ROW_GROUP * ROW_GROUP
    return [(0, w), (mid, mid + w), (n - w, n)]


def check_gemv(lib: ctypes.CDLL, fmt: str, blocks: torch.Tensor, x: torch.Tensor) -> None:
    """el_gemv on the interleaved `blocks` (row blocks) against float64, window by window."""
    n = blocks.shape[0]
    stored = interleave(blocks, fmt)
    k = x.numel()
    nb = k // QK
    raw, d, s, q = quantize_act(lib, x)
    e = x.double() - (d.double().unsqueeze(-1) * q.double()).flatten()
    # activation quantization: round to nearest on the grid d, |q| <= 127, s = d * sum(q)
    assert torch.all(e.abs().view(nb, QK) <= d.double().unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-45)
    assert int(q.abs().max()) <= 127
    assert torch.allclose(s.double(), d.double() * q.double().sum(-1), rtol=1e-6, atol=0)
    gemv = lib.el_gemv_q4 if fmt == "q4" else lib.el_gemv_q8
    for r0, r1 in windows(n, k):
        y = torch.full((n,), float("nan"))
        gemv(stored.data_ptr(), k, raw.data_ptr(), y.data_ptr(), r0, r1)
        assert torch.isnan(y[:r0]).all() and torch.isnan(y[r1:]).all()  # only rows r0..r1 written
        ref, magnitude = exact_sum(fmt, blocks[r0:r1], d, s, q)
        bound = (nb + 4) * U * magnitude + 1e-30
        err = (y[r0:r1].double() - ref).abs()
        assert torch.all(err <= bound), f"rows {r0}..{r1}: worst {(err / bound).max():.2f} x the bound"
        w = dequantize({"qweight": interleave(blocks[r0:r1], fmt)}, fmt).double()
        full_ref = w @ x.double()
        full_bound = bound + w.abs() @ e.abs()
        assert torch.all((y[r0:r1].double() - full_ref).abs() <= full_bound)


# ---------------------------------------------------------------------------- GEMV vs float64


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("shape", SMOLLM2_SHAPES + QWEN_SHAPES + ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_random_blocks_every_model_shape(lib: ctypes.CDLL, fmt: str, shape: tuple[int, int]) -> None:
    n, k = shape
    blocks = random_blocks(fmt, n, k, seed=n + k)
    x = torch.randn(k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-1, 1, k)
    check_gemv(lib, fmt, blocks, x)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_gemv_quantized_real_weights(lib: ctypes.CDLL, fmt: str, smollm2_gguf: Path) -> None:
    """SmolLM2's own weights, through the converter's quantizer."""
    from edgellm.convert.pipeline import open_source

    source = open_source(smollm2_gguf)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.3.self_attn.k_proj.weight"):
        w = source.load_tensor(name).float()
        blocks = row_blocks(quantize(w, fmt)["qweight"], fmt)
        x = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(1))
        x[:64] *= 30.0  # an outlier-heavy first two blocks, as real activations have
        check_gemv(lib, fmt, blocks, x)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_zero_blocks_and_extreme_scales(lib: ctypes.CDLL, fmt: str) -> None:
    n, k = 8, 256
    blocks = random_blocks(fmt, n, k, seed=7).view(n, k // QK, -1)
    blocks[0] = 0  # a zero row: d = m = 0
    blocks[1, 3] = 0  # one zero block
    big, tiny = torch.tensor([65504.0]).half(), torch.tensor([2.0**-24]).half()  # f16 max, smallest subnormal
    blocks[2, :, 0:2] = _f16_bytes(big)
    blocks[3, :, 0:2] = _f16_bytes(tiny)
    if fmt == "q4":
        blocks[4, :, 2:4] = _f16_bytes(-big)
        blocks[5, :, 2:4] = _f16_bytes(tiny)
    blocks = blocks.view(n, -1).contiguous()
    for scale in (1.0, 1e-30, 1e20):
        x = torch.randn(k, generator=torch.Generator().manual_seed(3)) * scale
        x[32:64] = 0.0  # a zero activation block: d = 0, q = 0, s = 0
        x[64] = 127.0 * scale  # a block whose maximum is on the grid
        check_gemv(lib, fmt, blocks, x)
    y = torch.empty(n)
    raw = quantize_act(lib, torch.zeros(k))[0]
    stored = interleave(blocks, fmt)
    (lib.el_gemv_q4 if fmt == "q4" else lib.el_gemv_q8)(stored.data_ptr(), k, raw.data_ptr(), y.data_ptr(), 0, n)
    assert torch.all(y == 0)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_gemm_and_threaded_linear_equal_single_gemvs(lib: ctypes.CDLL, fmt: str) -> None:
    """el_gemm (m rows: tiles of 4 and a tail), a row group alone or paired, and el_linear on a 3-thread pool compute each row exactly
    as el_gemv does; el_linear refuses K not a multiple of 32 and N not a multiple of 8."""
    n, k, m = 336, 192, 5
    blocks = interleave(random_blocks(fmt, n, k, seed=11), fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(12))
    gemv = lib.el_gemv_q4 if fmt == "q4" else lib.el_gemv_q8
    gemm = lib.el_gemm_q4 if fmt == "q4" else lib.el_gemm_q8
    singles = torch.empty(m, n)
    raws = []
    for i in range(m):
        raws.append(quantize_act(lib, x[i].contiguous())[0])
        gemv(blocks.data_ptr(), k, raws[-1].data_ptr(), singles[i].data_ptr(), 0, n)
    for r in range(0, n, ROW_GROUP):  # each row group alone (the AVX-512 kernels take two at once) has the same bits
        alone = torch.empty(n)
        gemv(blocks.data_ptr(), k, raws[0].data_ptr(), alone.data_ptr(), r, r + ROW_GROUP)
        assert torch.equal(alone[r:r + ROW_GROUP], singles[0, r:r + ROW_GROUP]), r
    xq = torch.stack(raws)
    y = torch.full((m, n), float("nan"))
    gemm(blocks.data_ptr(), k, xq.data_ptr(), m, y.data_ptr(), n, 16, 296)
    assert torch.equal(y[:, 16:296], singles[:, 16:296]) and torch.isnan(y[:, :16]).all() and torch.isnan(y[:, 296:]).all()
    code = int(fmt[1:])
    pool = lib.el_pool_create(3)
    try:
        for p in (None, pool):
            y = torch.empty(m, n)
            assert lib.el_linear(p, code, blocks.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr()) == 0
            assert torch.equal(y, singles)
    finally:
        lib.el_pool_destroy(pool)
    assert lib.el_linear(None, code, blocks.data_ptr(), n, k - 1, x.data_ptr(), m, y.data_ptr()) == -1
    assert lib.el_linear(None, code, blocks.data_ptr(), n - 4, k, x.data_ptr(), m, y.data_ptr()) == -1


# ---------------------------------------------------------------------------- selection


def test_cpu_check_agrees_with_proc_cpuinfo() -> None:
    scalar = native._scalar_library(native.LIB_DIR)
    if scalar is None or not Path("/proc/cpuinfo").exists():
        pytest.skip("no scalar library built, or no /proc/cpuinfo")
    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert scalar.el_cpu_allows(b"scalar") == 1
    assert scalar.el_cpu_allows(b"no-such-variant") == 0
    if "avx2" in native.variant_names():
        # CPUID + XCR0 may only be stricter than the flags the kernel lists, never looser
        assert scalar.el_cpu_allows(b"avx2") <= ("avx2" in flags and "fma" in flags and "f16c" in flags)
        assert scalar.el_cpu_allows(b"avx512") <= ("avx512_vnni" in flags and "avx512bw" in flags)
        assert scalar.el_cpu_allows(b"avx512bf16") <= (scalar.el_cpu_allows(b"avx512") and "avx512_bf16" in flags)
        assert scalar.el_cpu_xcr0() & 0x3 == 0x3  # x87 and SSE state are always on


def _fake_library(tmp_path: Path, name: str, body: str) -> Path:
    """A library with the real scalar kernels but ``el_linear`` replaced by ``body``."""
    cc = build.find_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "csrc"
    shutil.copytree(build.CSRC, src, dirs_exist_ok=True)
    linear = (src / "ops" / "linear.c").read_text()
    (src / "ops" / "linear.c").write_text(linear.replace("int el_linear(", "int el_linear_real(") + "\n" + body)
    out = tmp_path / "lib" / f"libedgellm_{name}.so"
    build.compile_library(cc, build.sources(src), out, ("-DEL_SCALAR",), include=src)
    shutil.copy(native.library_path("scalar"), tmp_path / "lib" / "libedgellm_scalar.so")
    return out.parent


TRAP = """int el_linear(el_pool *p, int f, const void *w, int n, int k, const float *x, int m, float *y) {
    (void)p; (void)f; (void)w; (void)n; (void)k; (void)x; (void)m; (void)y; __builtin_trap(); }"""
WRONG = """int el_linear(el_pool *p, int f, const void *w, int n, int k, const float *x, int m, float *y) {
    int r = el_linear_real(p, f, w, n, k, x, m, y); y[1] = 2.0f * y[1] + 1.0f; return r; }"""


@pytest.mark.skipif("scalar" not in RUNNABLE, reason="needs the scalar library")
@pytest.mark.parametrize(("body", "why"), [(TRAP, r"killed by SIG(ILL|TRAP)"), (WRONG, r"self-test failed: q4 GEMV gave")])
def test_a_trapping_or_wrong_variant_is_disqualified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, why: str
) -> None:
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    best = native.variant_names()[0]
    lib_dir = _fake_library(tmp_path, best, body)
    allowed = native._scalar_library(native.LIB_DIR).el_cpu_allows(best.encode())
    expect = why if allowed else "does not allow it"
    with pytest.raises(KernelUnavailableError, match=rf"^EDGELLM_KERNEL={best} cannot run here: .*{expect}"):
        native.choose(lib_dir, forced=best)
    name, reason = native.choose(lib_dir)  # not forced: the next one that works (scalar only when forced)
    assert name == "torch" and f"{best}: " in reason and "scalar: used only when forced" in reason
    if allowed:  # the verdict is cached per (library hash, CPU): the second choose() did not probe again
        cache = json.loads((tmp_path / "home" / "kernels" / "verdicts.json").read_text())
        assert len(cache) == 1 and re.search(why, next(iter(cache.values())))
        assert next(iter(cache)).startswith(f"{best}:")


def test_forced_kernels(tmp_path: Path) -> None:
    for v in RUNNABLE:
        assert native.choose(native.LIB_DIR, forced=v) == (v, f"forced by EDGELLM_KERNEL={v}")
    assert native.choose(native.LIB_DIR, forced="torch")[0] == "torch"
    with pytest.raises(KernelUnavailableError, match=r"EDGELLM_KERNEL=bogus is not a kernel of this machine.*torch"):
        native.choose(native.LIB_DIR, forced="bogus")
    missing = [v for v in native.variant_names() if v not in RUNNABLE]
    for v in missing:
        with pytest.raises(KernelUnavailableError, match=rf"EDGELLM_KERNEL={v} cannot run here"):
            native.choose(native.LIB_DIR, forced=v)
    assert native.choose(native.LIB_DIR)[0] == (RUNNABLE[0] if RUNNABLE[0] != "scalar" else "torch")
    empty = tmp_path / "empty"
    empty.mkdir()
    name, why = native.choose(empty)
    assert name == "torch" and "not built" in why


@pytest.mark.skipif(not RUNNABLE, reason="no native kernel library on this machine")
def test_a_build_from_other_sources_is_not_loaded(tmp_path: Path) -> None:
    """A checkout updated without rebuilding: its libraries may read the model description otherwise."""
    lib_dir = tmp_path / "lib"
    shutil.copytree(native.LIB_DIR, lib_dir)
    assert native.stale_build(lib_dir) is None  # this checkout's build
    info = json.loads((lib_dir / build.BUILD_INFO).read_text())
    (lib_dir / build.BUILD_INFO).write_text(json.dumps({**info, "sources_sha256": "0" * 64}))
    name, why = native.choose(lib_dir)
    assert name == "torch" and "built from other C sources" in why and "python -m edgellm.kernels.build" in why
    with pytest.raises(KernelUnavailableError, match=r"cannot run here: the kernel libraries were built from other"):
        native.choose(lib_dir, forced=RUNNABLE[0])
    assert native.choose(lib_dir, forced="torch")[0] == "torch"


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edgellm.convert.pipeline import convert
    from tests.support.tiny import make_tiny

    root = tmp_path_factory.mktemp("kernels-art")
    make_tiny(root / "hf", "llama", tied=True)
    return convert(root / "hf", root / "q4", quantization="q4f16_1", progress=False)


def test_info_names_the_kernel_and_a_forced_unusable_one_is_a_one_line_error(tiny_artifact: Path) -> None:
    def info(kernel: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "edgellm", "info", str(tiny_artifact)], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "EDGELLM_KERNEL": kernel})

    best = info("")
    assert best.returncode == 0
    assert f"matmul kernel       {RUNNABLE[0]} (best variant this CPU and OS run" in best.stdout
    assert "matmul kernel       torch (EDGELLM_KERNEL=torch)" in info("torch").stdout
    lib = native.load_library()
    bf16 = lib is not None and lib.el_variant().decode() == "avx512" and lib.el_cpu_allows(b"avx512bf16") == 1
    assert ("prefill matmul      native bf16 GEMM (AVX512-BF16)" in best.stdout) == bf16
    assert "prefill matmul      native int8 GEMM (el_gemm_i8" in info("avx2").stdout or "avx2" not in RUNNABLE
    assert "prefill matmul      torch's bf16 GEMM on slabs the library dequantizes" in info("scalar").stdout \
        or "scalar" not in RUNNABLE
    bad_gemm = subprocess.run([sys.executable, "-m", "edgellm", "info", str(tiny_artifact)], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "EDGELLM_PREFILL_GEMM": "fp8"})
    assert bad_gemm.returncode != 0 and bad_gemm.stdout == ""
    assert bad_gemm.stderr.strip().splitlines() == [
        "edgellm: error: EDGELLM_PREFILL_GEMM=fp8 is not a prefill GEMM; choose one of: int8, f32"]
    bad = info("bogus")
    assert bad.returncode != 0 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "edgellm: error: EDGELLM_KERNEL=bogus is not a kernel of this machine "
        f"({__import__('platform').machine()}); choose one of: {', '.join((*native.variant_names(), 'torch'))}"
    ]
    out = _run("from edgellm.quant.dispatch import select_kernel; select_kernel('q4')", EDGELLM_KERNEL="bogus")
    assert "KernelUnavailableError: EDGELLM_KERNEL=bogus is not a kernel of this machine" in out.stderr
    out = _run("from edgellm.quant.dispatch import select_kernel; print(select_kernel('q4').name)", EDGELLM_KERNEL="torch")
    assert out.stdout.strip() == "cpu-int4pack-bf16"


def test_no_compiler_build_warns_once_and_torch_path_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CC", str(tmp_path / "no-such-cc"))
        build.build_quietly(tmp_path / "lib")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgellm: warning: native kernels not built")
    assert not list((tmp_path / "lib").glob("*.so"))
    # with no library the matmuls take torch's kernels and stay correct
    out = _run(
        "import torch; from edgellm.quant.layers import make_linear; from edgellm.quant.formats import quantize, dequantize\n"
        "w = torch.randn(64, 96); p = quantize(w, 'q4'); lin = make_linear('q4', p); x = torch.randn(1, 96)\n"
        "ref = x.double() @ dequantize(p, 'q4').double().T\n"
        "print(lin.kernel.name, float((lin(x).double() - ref).norm() / ref.norm()))",
        EDGELLM_KERNEL="torch",
    )
    name, rel = out.stdout.split()
    assert name == "cpu-int4pack-bf16" and float(rel) < 1e-2


def test_dispatch_uses_native_for_small_m_only() -> None:
    torch.manual_seed(0)
    w = torch.randn(200, 128)
    for fmt in ("q4", "q8"):
        kernel = dispatch.select_kernel(fmt)
        assert kernel.name == f"cpu-native-{fmt}"
        state = kernel.prepare(quantize(w, fmt))
        wq = dequantize(quantize(w, fmt), fmt).double()
        for m in (1, dispatch.NATIVE_MAX_M[fmt], dispatch.NATIVE_MAX_M[fmt] + 1, 100):
            x = torch.randn(m, 128)
            ref = x.double() @ wq.T
            y = kernel.matmul(x, state)
            assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
        x = torch.randn(1, 128)
        assert torch.equal(kernel.matmul(x, state), kernel.matmul(x, state))  # no state changes between calls


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_prefill_matmuls_take_the_native_bf16_gemm(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """Where the CPU has AVX512-BF16, prefill-sized inputs go through el_gemm_bf16 on one thread, and on more
    when torch's OpenMP threads wait passively (edgellm/openmp.py): the float32 sum of the bf16 products, within
    K 2^-24 sum|x w| of the float64 one. Where OpenMP spins, more threads take torch's bf16 GEMM, which also
    rounds its output to bf16."""
    from edgellm import openmp

    lib = native.load_library()
    if lib is None or lib.el_variant().decode() != "avx512" or lib.el_cpu_allows(b"avx512bf16") != 1:
        pytest.skip("no AVX512-BF16 GEMM on this machine")
    kernel = dispatch.select_kernel(fmt)
    parts = quantize(torch.randn(200, 96), fmt)
    state = kernel.prepare(parts)
    x = torch.randn(70, 96)
    xb, wb = x.to(torch.bfloat16).double(), dequantize(parts, fmt).to(torch.bfloat16).double()
    ref, bound = xb @ wb.T, 96 * 2.0**-24 * (xb.abs() @ wb.abs().T)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(openmp, "PASSIVE", False)
        torch_gemm = kernel.matmul(x, state).double()
        monkeypatch.setattr(dispatch, "_dense_mm", lambda *a: pytest.fail("torch's GEMM ran"))
        monkeypatch.setattr(openmp, "PASSIVE", True)
        ours = {2: kernel.matmul(x, state).double()}
        torch.set_num_threads(1)
        monkeypatch.setattr(openmp, "PASSIVE", False)
        ours[1] = kernel.matmul(x, state).double()
    finally:
        torch.set_num_threads(previous)
    for y in ours.values():
        assert ((y - ref).abs() <= bound).all()
    assert ((torch_gemm - ref).abs() <= 2.0**-8 * ref.abs() + bound).all()


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_gemm_bf16_is_the_bf16_product_summed_in_float(lib: ctypes.CDLL, fmt: str) -> None:
    """el_gemm_bf16 (prefill's matmul on AVX512-BF16) against float64 sums of the same bf16-rounded operands:
    products of two bf16 are exact in float32 and vdpbf16ps adds them one by one, so |y - ref| <=
    K 2^-24 sum_k |x_k w_k| (K rounded float32 additions). Tiles of 32 activation rows and 32 weight rows end
    anywhere (M and N not multiples of 32), every output is written, on a 3-thread pool too. Libraries
    other than avx512, and CPUs or OSes without AVX512-BF16, return -2 and write nothing."""
    allowed = lib.el_variant().decode() == "avx512" and lib.el_cpu_allows(b"avx512bf16") == 1
    code = int(fmt[1:])
    pool = lib.el_pool_create(3)
    try:
        for n, k, m in ((8, 32, 1), (40, 160, 33), (56, 96, 32), (1000, 224, 70), (896, 896, 5), (192, 576, 100)):
            stored = interleave(random_blocks(fmt, n, k, seed=n + k), fmt)
            w = dequantize({"qweight": stored}, fmt).to(torch.bfloat16).double()
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.logspace(-1, 1, k)
            xb = x.to(torch.bfloat16).double()
            ref, bound = xb @ w.T, k * 2.0**-24 * (xb.abs() @ w.abs().T)
            for p in (None, pool):
                y = torch.full((m, n), float("nan"))
                rc = lib.el_gemm_bf16(p, code, stored.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr())
                if not allowed:
                    assert rc == -2 and torch.isnan(y).all()
                    continue
                assert rc == 0 and ((y.double() - ref).abs() <= bound).all(), (n, k, m)
        if allowed:
            for n, k in ((12, 32), (8, 48), (0, 32)):
                assert lib.el_gemm_bf16(None, code, stored.data_ptr(), n, k, x.data_ptr(), 1, y.data_ptr()) == -1
    finally:
        lib.el_pool_destroy(pool)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_gemm_f32_is_the_float_product_of_the_exact_weights(lib: ctypes.CDLL, fmt: str) -> None:
    """el_gemm_f32 (the native prefill's matmul without AVX512-BF16, in every variant) against float64 products of
    the exactly dequantized weights (d q + m is a float32 value: the dequantization rounds like float32 does) and
    unrounded inputs: one float32 multiply-add chain per output, so |y - ref| <= K 2^-23 sum_k |x_k w_k|. M odd and
    past any tile, N a multiple of 8 but not of 16 or 32, K a multiple of 32 but not of 64 and past the K block; the
    same bits on a 3-thread pool and for any split of M (row by row); bad shapes are refused."""
    code = int(fmt[1:])
    pool = lib.el_pool_create(3)
    try:
        for n, k, m in ((8, 32, 1), (40, 160, 33), (56, 96, 7), (1000, 224, 71), (200, 544, 13), (24, 800, 101)):
            stored = interleave(random_blocks(fmt, n, k, seed=n + k), fmt)
            w = dequantize({"qweight": stored}, fmt).double()
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.logspace(-1, 1, k)
            ref, bound = x.double() @ w.T, k * 2.0**-23 * (x.double().abs() @ w.abs().T)
            ys = []
            for p in (None, pool):
                y = torch.full((m, n), float("nan"))
                assert lib.el_gemm_f32(p, code, stored.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr()) == 0
                assert ((y.double() - ref).abs() <= bound).all(), (n, k, m)
                ys.append(y)
            assert torch.equal(ys[0], ys[1])
            y1 = torch.full((1, n), float("nan"))
            for i in (0, m - 1):
                assert lib.el_gemm_f32(pool, code, stored.data_ptr(), n, k, x[i].contiguous().data_ptr(), 1,
                                       y1.data_ptr()) == 0
                assert torch.equal(y1[0], ys[0][i])
        for n, k in ((12, 32), (8, 48), (0, 32)):
            assert lib.el_gemm_f32(None, code, stored.data_ptr(), n, k, x.data_ptr(), 1, y.data_ptr()) == -1
    finally:
        lib.el_pool_destroy(pool)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_gemm_f32_is_the_same_bits_on_every_fma_variant(fmt: str) -> None:
    """8 lanes (avx2, avxvnni) or 16 (avx512): each output is the same fused multiply-add chain over k, so the same
    bits; the scalar build (no FMA: a multiply, then an add) is only held to the float64 bound above."""
    fma = [v for v in RUNNABLE if v != "scalar"]
    if len(fma) < 2:
        pytest.skip("fewer than two FMA variants run here")
    n, k, m = 1000, 544, 37
    stored = interleave(random_blocks(fmt, n, k, seed=3), fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    outs = []
    for variant in fma:
        lib = abi.declare(ctypes.CDLL(str(native.library_path(variant))))
        y = torch.full((m, n), float("nan"))
        assert lib.el_gemm_f32(None, int(fmt[1:]), stored.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr()) == 0
        outs.append(y)
    assert all(torch.equal(outs[0], y) for y in outs[1:]), fma


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_dequant_bf16_is_the_rounded_float_weight(lib: ctypes.CDLL, fmt: str) -> None:
    """el_dequant_bf16 (the prefill path's weights) is bf16(d * q + m) of every weight, on a 3-thread
    pool too, and writes only the rows asked for; misaligned rows and K are refused."""
    n, k = 64, 160
    stored = interleave(random_blocks(fmt, n, k, seed=21), fmt)
    want = dequantize({"qweight": stored}, fmt).to(torch.bfloat16)
    pool = lib.el_pool_create(3)
    try:
        for p in (None, pool):
            out = torch.full((40, k), float("nan"), dtype=torch.bfloat16)
            assert lib.el_dequant_bf16(p, int(fmt[1:]), stored.data_ptr(), k, 16, 48, out.data_ptr()) == 0
            assert torch.equal(out[:32], want[16:48]) and torch.isnan(out[32:].float()).all()
    finally:
        lib.el_pool_destroy(pool)
    for r0, r1, kk in ((4, 16, k), (0, 12, k), (0, 16, k - 16)):
        assert lib.el_dequant_bf16(None, int(fmt[1:]), stored.data_ptr(), kk, r0, r1, out.data_ptr()) == -1


@pytest.mark.parametrize("stale", [True, False])
def test_run_says_when_a_stale_build_sends_it_to_torch(tiny_artifact: Path, stale: bool,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Libraries built from other C sources are skipped for torch's kernels (above): `run` warns in one line; torch
    asked for (EDGELLM_KERNEL=torch) is no surprise and gets no warning."""
    from edgellm.cli import main

    why = native.STALE_BUILD
    monkeypatch.setattr(native, "active_kernel", lambda: ("torch", why if stale else "EDGELLM_KERNEL=torch"))
    assert main(["run", str(tiny_artifact), "hello", "--max-tokens", "2", "--quiet"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "torch's kernels" in line]
    assert warned == ([f"edgellm: warning: running on torch's kernels (slower): {why}"] if stale else [])


@pytest.mark.parametrize("verb", ["serve", "bench"])
def test_serve_and_bench_say_when_a_stale_build_sends_them_to_torch(tiny_artifact: Path, verb: str,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The same one-line warning before `serve` starts (its model loads in the background) and before `bench`
    measures, `--quiet` or not; the verbs themselves are stood in for."""
    import edgellm.bench.command
    import edgellm.serve.app
    from edgellm.cli import main

    monkeypatch.setattr(native, "active_kernel", lambda: ("torch", native.STALE_BUILD))
    monkeypatch.setattr(edgellm.serve.app, "serve", lambda *a, **k: None)
    monkeypatch.setattr(edgellm.bench.command, "run", lambda args: 0)
    argv = [verb, str(tiny_artifact)] + (["--quiet"] if verb == "bench" else [])
    assert main(argv) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "torch's kernels" in line]
    assert warned == [f"edgellm: warning: running on torch's kernels (slower): {native.STALE_BUILD}"]
