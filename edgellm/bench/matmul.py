"""Microbenchmark of the quantized matmul kernels: ``python -m edgellm.bench.matmul``.

Prints µs per call (best of several rounds, so noise from other processes is filtered out) of
each format's dispatched kernel, float32 [M, K] -> float32 [M, N]. ``--alternatives`` also times
the paths the dispatch decisions were made against (see edgellm/quant/dispatch.py).
``--variants`` times every native kernel variant this machine runs against torch's packed kernels
on one thread, alternating them round by round, and prints GB/s of weight bytes read.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from edgellm.kernels import abi, native
from edgellm.quant import dispatch
from edgellm.quant.formats import FORMATS, SOURCE_ONLY, quantize

DEFAULT_SHAPES = ((1, 576, 1536), (1, 896, 4864), (64, 576, 1536))
# M, K, N of the matmuls of SmolLM2-135M and Qwen2.5-0.5B at M = 1 (decode)
MODEL_SHAPES = ((1, 576, 576), (1, 576, 1536), (1, 1536, 576), (1, 576, 49152),
                (1, 896, 896), (1, 896, 4864), (1, 4864, 896), (1, 896, 151936))


def time_us(fn: Callable[[], object], rounds: int = 7, round_s: float = 0.02) -> float:
    """Best-of-``rounds`` mean µs per call of ``fn``."""
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    fn()
    reps = max(1, min(1000, int(round_s / max(time.perf_counter() - t0, 1e-7))))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def _alternatives(m: int, k: int, n: int, w: torch.Tensor) -> dict[str, float]:
    """µs of the paths dispatch chose between, each forced on."""
    x = torch.randn(m, k)
    w16 = w.half()
    q8 = quantize(w, "q8")
    i8, i8_resident = dispatch._prepare_q8(q8), dispatch._prepare_q8_resident(q8)
    i4 = dispatch._prepare_q4(quantize(w, "q4"))
    big = sys.maxsize
    out = {
        "f16 upcast/call": time_us(lambda: x @ w16.float().t()),
        "f16 half GEMM": time_us(lambda: (x.half() @ w16.t()).float()),
        "q8 bf16 per call": time_us(lambda: dispatch._matmul_q8(x, i8)),
        "q8 bf16 resident": time_us(lambda: dispatch._matmul_q8(x, i8_resident)),
        "q4 int4pack": time_us(lambda: dispatch._matmul_q4(x, replace(i4, dense_min_m=big))),
    }
    if i4.layout is not None:
        out["q4 dense bf16"] = time_us(lambda: dispatch._matmul_q4(x, replace(i4, dense_min_m=0)))
        out["q4 unpack only"] = time_us(lambda: [dispatch._dense_q4_t(i4, a, b) for a, b in i4.slabs])
    if m <= 64:  # float32 activations: the slow path the bf16 cast avoids
        sz = i4.scales_and_zeros.float()
        out["int4pack f32 act"] = time_us(lambda: torch._weight_int4pack_mm_for_cpu(x, i4.packed, 32, sz))
    return out


def _call_linear(lib: ctypes.CDLL, code: int, blocks: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    lib.el_linear(None, code, blocks.data_ptr(), y.shape[1], x.shape[1], x.data_ptr(), x.shape[0], y.data_ptr())


def _variant_paths(m: int, k: int, n: int, fmt: str) -> dict[str, tuple[Callable[[], object], int]]:
    """{path: (call, weight bytes it reads)}: each runnable native variant and torch's kernel."""
    w = torch.randn(n, k) * 0.05
    parts = quantize(w, fmt)
    blocks = parts["qweight"]
    x = torch.randn(m, k)
    y = torch.empty(m, n)
    scalar = native._scalar_library(native.LIB_DIR)
    paths: dict[str, tuple[Callable[[], object], int]] = {}
    for v in native.variant_names():
        if native.verdict(v, native.LIB_DIR, scalar) is None:
            lib = abi.declare(ctypes.CDLL(str(native.library_path(v))))
            call = partial(_call_linear, lib, int(fmt[1:]), blocks, x, y)  # holds the tensors alive
            paths[f"{fmt} {v}"] = (call, blocks.numel())
    if native.load_library() is not None:  # prefill's path: bf16 slabs of the mapped blocks, torch's GEMM
        slabs = dispatch._native_kernel(fmt, 0).prepare(parts)  # max_m 0: every input takes the slabs
        paths[f"{fmt} bf16 slabs"] = (partial(dispatch._matmul_native, x, slabs), blocks.numel())
    if fmt == "q4":
        st4 = dispatch._prepare_q4(parts)
        paths["q4 torch int4pack"] = (partial(dispatch._matmul_q4, x, st4),
                                      st4.packed.numel() + 2 * st4.scales_and_zeros.numel())
    else:
        st8 = dispatch._prepare_q8_resident(parts)
        paths["q8 torch bf16 copy"] = (partial(dispatch._matmul_q8, x, st8), 2 * st8.n * st8.k)  # the bf16 copy
    return paths


def variant_table(shapes: list[tuple[int, int, int]], fmts: tuple[str, ...] = ("q4", "q8"), rounds: int = 15) -> None:
    """Print best and median µs and GB/s per path: the paths of one shape are timed in alternation,
    round by round, each round starting at the next path (so none always runs right after another)."""
    for m, k, n in shapes:
        for fmt in fmts:
            paths = _variant_paths(m, k, n, fmt)
            for call, _ in paths.values():  # warm up, and size a round to ~10 ms of the slowest path
                call()
            reps = {name: max(1, int(0.002 / max(time_us(call, rounds=1, round_s=0.002) * 1e-6, 1e-7)))
                    for name, (call, _) in paths.items()}
            times: dict[str, list[float]] = {name: [] for name in paths}
            names = list(paths)
            for r in range(rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    call = paths[name][0]
                    t0 = time.perf_counter()
                    for _ in range(reps[name]):
                        call()
                    times[name].append((time.perf_counter() - t0) / reps[name])
            for name, (_, nbytes) in paths.items():
                best, med = min(times[name]), statistics.median(times[name])
                print(f"M={m:<3} K={k:<5} N={n:<6} {name:<22} best {best * 1e6:8.1f} µs {nbytes / best / 1e9:6.2f} GB/s"
                      f"  median {med * 1e6:8.1f} µs {nbytes / med / 1e9:6.2f} GB/s", flush=True)


def _shape(text: str) -> tuple[int, int, int]:
    """M,K,N (argparse refuses anything else in one line)."""
    m, k, n = (int(v) for v in text.split(","))
    return m, k, n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", type=_shape, default=[], metavar="M,K,N",
                    help="add a shape (repeatable)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--alternatives", action="store_true", help="also time the non-chosen paths")
    ap.add_argument("--variants", action="store_true",
                    help="native variants vs torch, 1 thread, alternated (default shapes: both models' at M=1)")
    args = ap.parse_args(argv)
    if args.variants:
        torch.set_num_threads(1)
        shapes = args.shape or list(MODEL_SHAPES)
        print(f"torch {torch.__version__}, 1 thread, native {native.active_kernel()[0]}; 15 alternated rounds")
        variant_table(shapes)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = args.shape or list(DEFAULT_SHAPES)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}; µs per call (best of 7 rounds)")
    torch.manual_seed(0)
    for m, k, n in shapes:
        w = torch.randn(n, k) * 0.05
        x = torch.randn(m, k)
        row = {}
        for fmt in (f for f in FORMATS if f not in SOURCE_ONLY):  # (a GGUF's own blocks have no quantizer)
            kernel = dispatch.select_kernel(fmt, "cpu")
            state = kernel.prepare(quantize(w, fmt))
            row[fmt] = time_us(partial(kernel.matmul, x, state))
        print(f"M={m:<4} K={k:<5} N={n:<6} " + "  ".join(f"{f}={v:8.1f}" for f, v in row.items()), flush=True)
        if args.alternatives:
            for name, v in _alternatives(m, k, n, w).items():
                print(f"{'':30}{name:<18}{v:9.1f}", flush=True)


if __name__ == "__main__":
    main()
