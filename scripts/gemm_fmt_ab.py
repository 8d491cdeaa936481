"""Where a batched decode step's matrix time goes, per weight role and block format, at M activation rows: every
projection of an artifact (and its LM head) through `el_gemm_fmt` once per pass, in the model's order (so the weights
stream from memory as in a step), each call timed in thread CPU time (one thread, no pool). With two libraries, each
pass runs both, alternated (AB, BA, ...), and the table gives B/A per role; same outputs says whether every call's
floats had the same bits on both sides.

    python -m edgellm.kernels.build --out /tmp/new
    python scripts/gemm_fmt_ab.py ARTIFACT_DIR OLD.so /tmp/new/libedgellm_avx512.so --rows 1 2 4 8 --passes 4
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from edgellm.artifact.reader import Artifact, open_artifact
from edgellm.kernels import abi
from edgellm.quant.formats import EL_FORMAT_CODES

Q8A_BYTES = 40  # el_block_q8a: float d, float s, int8 qs[32]


def load_weights(art: Artifact) -> list[tuple[str, str, np.ndarray]]:
    """(role, format, stored array) of every projection and the LM head, in layer order."""
    formats = art.config.quantization.formats
    found = {name[: -len(".qweight")]: np.ascontiguousarray(t) for name, t in art.weights(arrays=True).items()
             if name.endswith(".qweight") and name[: -len(".qweight")] in formats}

    def order(name: str) -> tuple[int, str]:
        layer = re.search(r"layers\.(\d+)\.", name)
        return (int(layer.group(1)) if layer else 1 << 30, name)

    return [(re.sub(r".*\.", "", name), formats[name], found[name]) for name in sorted(found, key=order)
            if name != "model.embed_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("libraries", nargs="+", help="one library, or two to compare (A B)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    if len(args.libraries) > 2:
        raise SystemExit("one library, or two to compare")
    libs = [abi.declare(ctypes.CDLL(p)) for p in args.libraries]
    art = open_artifact(args.artifact)
    weights = load_weights(art)
    model = art.config.model
    hidden = model.hidden_size
    k_of = {"down_proj": model.intermediate_size, "o_proj": model.num_attention_heads * model.head_dim}
    rng = np.random.default_rng(0)
    acts: dict[int, np.ndarray] = {}
    for k in {hidden, *k_of.values()}:
        x = rng.standard_normal((max(args.rows), k)).astype(np.float32)
        q = np.empty((max(args.rows), k // 32 * Q8A_BYTES), np.uint8)
        for i in range(x.shape[0]):
            libs[0].el_quantize_act(x[i].ctypes.data, k, q[i].ctypes.data)
        acts[k] = q
    times: dict[tuple[int, int, str, str], list[float]] = defaultdict(list)  # (side, M, role, fmt) -> per pass
    outputs: dict[tuple[int, int], list[bytes]] = {}
    for p in range(args.passes):
        sides = list(range(len(libs))) if p % 2 == 0 else list(reversed(range(len(libs))))
        for side in sides:
            lib = libs[side]
            for m in args.rows:
                spent: dict[tuple[str, str], float] = defaultdict(float)
                seen = []
                for role, fmt, w in weights:
                    n, k = w.shape[0] * 8, k_of.get(role, hidden)
                    y = np.empty((m, n), np.float32)
                    t0 = time.thread_time()
                    lib.el_gemm_fmt(EL_FORMAT_CODES[fmt], w.ctypes.data, k, acts[k].ctypes.data, m, y.ctypes.data, n,
                                    0, n)
                    spent[(role, fmt)] += time.thread_time() - t0
                    if p == 0:
                        seen.append(y.tobytes())
                for key, t in spent.items():
                    times[(side, m, *key)].append(t)
                if p == 0:
                    outputs[(side, m)] = seen
    groups = sorted({(role, fmt) for role, fmt, _ in weights}, key=lambda g: [w[:2] for w in weights].index(g))
    count = {g: sum(1 for role, fmt, _ in weights if (role, fmt) == g) for g in groups}
    print(f"{args.artifact.name}: ms of el_gemm_fmt per step (median of {args.passes} passes, thread CPU time)")
    for m in args.rows:
        print(f"M = {m}:")
        total = [0.0] * len(libs)
        for g in groups:
            med = [statistics.median(times[(s, m, *g)]) for s in range(len(libs))]
            one = [statistics.median(times[(s, args.rows[0], *g)]) for s in range(len(libs))]
            total = [a + b for a, b in zip(total, med, strict=True)]
            cells = "  ".join(f"{'AB'[s]} {1e3 * med[s]:7.2f} ms ({med[s] / (m / args.rows[0] * one[s]):.2f} of "
                              f"M={args.rows[0]} per row)" for s in range(len(libs)))
            ratio = f"  B/A {med[1] / med[0]:.3f}" if len(libs) == 2 else ""
            print(f"  {g[0]:10s} {g[1]:5s} x{count[g]:<3d} {cells}{ratio}")
        ratio = f"  B/A {total[1] / total[0]:.3f}" if len(libs) == 2 else ""
        print(f"  {'all':16s}    " + "  ".join(f"{'AB'[s]} {1e3 * total[s]:7.2f} ms" for s in range(len(libs))) + ratio)
    if len(libs) == 2:
        print("same outputs:", all(outputs[(0, m)] == outputs[(1, m)] for m in args.rows))


if __name__ == "__main__":
    main()
