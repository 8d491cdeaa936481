"""Microbenchmark of the quantized matmul kernels: ``python -m edgellm.quant.microbench``.

Prints µs per call (best of several rounds, so noise from other processes is filtered out) of
each format's dispatched kernel, float32 [M, K] -> float32 [M, N]. ``--alternatives`` also times
the paths the dispatch decisions were made against (see edgellm/quant/dispatch.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from edgellm.quant import dispatch
from edgellm.quant.formats import FORMATS, quantize

DEFAULT_SHAPES = ((1, 576, 1536), (1, 896, 4864), (64, 576, 1536))


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
    i8 = dispatch._prepare_q8(quantize(w, "q8"))
    i4 = dispatch._prepare_q4(quantize(w, "q4"))
    big = sys.maxsize
    out = {
        "f16 upcast/call": time_us(lambda: x @ w16.float().t()),
        "f16 half GEMM": time_us(lambda: (x.half() @ w16.t()).float()),
        "q8 int8pack": time_us(lambda: dispatch._matmul_q8(x, replace(i8, dense_min_m=big))),
        "q8 dense bf16": time_us(lambda: dispatch._matmul_q8(x, replace(i8, dense_min_m=0))),
        "q4 int4pack": time_us(lambda: dispatch._matmul_q4(x, replace(i4, dense_min_m=big))),
    }
    if i4.layout is not None:
        out["q4 dense bf16"] = time_us(lambda: dispatch._matmul_q4(x, replace(i4, dense_min_m=0)))
        out["q4 unpack only"] = time_us(lambda: [dispatch._dense_q4_t(i4, a, b) for a, b in i4.slabs])
    if m <= 64:  # float32 activations: the slow paths the bf16 cast avoids
        out["int8pack f32 act"] = time_us(lambda: torch._weight_int8pack_mm(x, i8.qweight, i8.scales_f32))
        sz = i4.scales_and_zeros.float()
        out["int4pack f32 act"] = time_us(lambda: torch._weight_int4pack_mm_for_cpu(x, i4.packed, 32, sz))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=[], metavar="M,K,N", help="add a shape (repeatable)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--alternatives", action="store_true", help="also time the non-chosen paths")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] or list(DEFAULT_SHAPES)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}; µs per call (best of 7 rounds)")
    torch.manual_seed(0)
    for m, k, n in shapes:
        w = torch.randn(n, k) * 0.05
        x = torch.randn(m, k)
        row = {}
        for fmt in FORMATS:
            kernel = dispatch.select_kernel(fmt, "cpu")
            state = kernel.prepare(quantize(w, fmt))
            row[fmt] = time_us(partial(kernel.matmul, x, state))
        print(f"M={m:<4} K={k:<5} N={n:<6} " + "  ".join(f"{f}={v:8.1f}" for f, v in row.items()), flush=True)
        if args.alternatives:
            for name, v in _alternatives(m, k, n, w).items():
                print(f"{'':30}{name:<18}{v:9.1f}", flush=True)


if __name__ == "__main__":
    main()
