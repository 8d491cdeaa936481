"""Prefill's matmuls per weight role and block format: `el_gemm_f32` (float32 operands, exact weights) against
`el_gemm_i8` (int8 activation blocks, integer products) at M activation rows, on an artifact's own weights, no pool,
each call timed in thread CPU time, the two alternated per weight, and how far apart their outputs are (the int8
quantization of the inputs: relative to the largest output).

    python scripts/prefill_gemm_ab.py ARTIFACT_DIR edgellm/kernels/_lib/libedgellm_avx2.so --rows 512 --passes 3
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_fmt_ab import load_weights  # noqa: E402

from edgellm.artifact.reader import open_artifact  # noqa: E402
from edgellm.kernels import abi  # noqa: E402
from edgellm.quant.formats import EL_FORMAT_CODES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("library", help="a kernel library with el_gemm_i8 (an x86 one)")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    lib = abi.declare(ctypes.CDLL(args.library))
    art = open_artifact(args.artifact)
    model = art.config.model
    k_of = {"down_proj": model.intermediate_size, "o_proj": model.num_attention_heads * model.head_dim}
    weights = [w for w in load_weights(art) if w[0] != "lm_head"]  # prefill multiplies the head for one row only
    rng = np.random.default_rng(0)
    acts = {k: rng.standard_normal((args.rows, k)).astype(np.float32)
            for k in {model.hidden_size, *k_of.values()}}
    times: dict[tuple[str, str, str], list[float]] = defaultdict(list)  # (gemm, role, fmt) -> per pass
    flops: dict[tuple[str, str], float] = defaultdict(float)
    apart: dict[tuple[str, str], float] = defaultdict(float)
    for p in range(args.passes):
        spent: dict[tuple[str, str, str], float] = defaultdict(float)
        for role, fmt, w in weights:
            n, k = w.shape[0] * 8, k_of.get(role, model.hidden_size)
            x, out = acts[k], {}
            order = ("f32", "i8") if p % 2 == 0 else ("i8", "f32")
            for gemm in order:
                y = np.empty((args.rows, n), np.float32)
                t0 = time.thread_time()
                rc = getattr(lib, f"el_gemm_{gemm}")(None, EL_FORMAT_CODES[fmt], w.ctypes.data, n, k, x.ctypes.data,
                                                     args.rows, y.ctypes.data)
                spent[(gemm, role, fmt)] += time.thread_time() - t0
                out[gemm] = y if rc == 0 else None
            if p == 0:
                flops[(role, fmt)] += 2.0 * args.rows * n * k
                if out["i8"] is not None:
                    ref = out["f32"].astype(np.float64)
                    apart[(role, fmt)] = max(apart[(role, fmt)], float(np.abs(out["i8"] - ref).max() / np.abs(ref).max()))
        for key, t in spent.items():
            times[key].append(t)
    print(f"{args.artifact.name}, M = {args.rows}: GFLOP/s (median of {args.passes} passes, thread CPU time); "
          "i8 -2: the format stays on el_gemm_f32")
    total = {"f32": 0.0, "i8": 0.0}
    for role, fmt in flops:
        med = {g: statistics.median(times[(g, role, fmt)]) for g in ("f32", "i8")}
        taken = (role, fmt) in apart
        total["f32"] += med["f32"]
        total["i8"] += med["i8"] if taken else med["f32"]
        i8 = f"{flops[(role, fmt)] / med['i8'] / 1e9:6.1f}  ({med['f32'] / med['i8']:.2f}x, outputs apart by " \
             f"{apart[(role, fmt)]:.1e})" if taken else "    -2"
        print(f"  {role:10s} {fmt:5s} f32 {flops[(role, fmt)] / med['f32'] / 1e9:6.1f}  i8 {i8}")
    print(f"  prefill's matmuls: {1e3 * total['f32']:.0f} ms -> {1e3 * total['i8']:.0f} ms "
          f"({total['f32'] / total['i8']:.2f}x)")


if __name__ == "__main__":
    main()
