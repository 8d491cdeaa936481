"""A/B two builds of the native kernel library on one engine: the same model, weights and cache, the
decoder swapped between rounds (alternated), decode speed in tokens per CPU-second of the process
(`--clock cpu`, the default: robust to a shared machine's time slicing, not to its memory traffic; one
thread only) or per second of wall clock (`--clock wall`: for 2+ threads, on a quiet machine):

    python -m edgellm.kernels.build --out /tmp/new          # the library under test
    python scripts/decode_ab.py qwen2.5-coder-0.5b q4f16_1 OLD.so /tmp/new/libedgellm_avx512.so \\
        --threads 1 --context 512 --rounds 8

Prints each side's median and the per-round ratios; "same tokens" says whether both sides decoded the
same greedy tokens.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

import edgellm.runtime.engine as engine_module
from edgellm.bench.backends import PROMPT_TEXT, fixed_ids
from edgellm.generation import GenerationParams
from edgellm.kernels import abi, native
from edgellm.kernels.decoder import NativeDecoder
from edgellm.resolve import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("quantization")
    ap.add_argument("library_a")
    ap.add_argument("library_b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens already in the cache (default 512)")
    ap.add_argument("--tokens", type=int, default=96, help="tokens decoded per round and side (default 96)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="what a token's time is measured in")
    args = ap.parse_args()

    captured: dict = {}
    attach = engine_module.attach_native_decoder

    def capture(model, config, weights, threads, kv_dtype=torch.float32):  # the weights the engine maps
        captured.update(model=model, config=config, weights=weights)
        return attach(model, config, weights, threads, kv_dtype)

    engine_module.attach_native_decoder = capture
    folder = resolve_model(args.model, quantization=args.quantization, progress=False)
    engine = engine_module.Engine.load(folder, threads=args.threads, context_window=args.context + args.tokens + 64,
                                       progress=False)
    model = captured["model"]
    decoders = {side: NativeDecoder(abi.declare(ctypes.CDLL(path)), model, captured["weights"],
                                    captured["config"].quantization.formats, native.pool(args.threads))
                for side, path in (("A", args.library_a), ("B", args.library_b))}
    prompt = fixed_ids(engine.tokenizer.encode, PROMPT_TEXT * (1 + args.context // 8), args.context)
    engine.generate(prompt, GenerationParams(max_tokens=1, temperature=0.0))  # the prompt is cached from here on
    params = GenerationParams(max_tokens=args.tokens, temperature=0.0, repetition_penalty=1.0, ignore_eos=True,
                              prefix_reuse="any")
    speeds: dict[str, list[float]] = {"A": [], "B": []}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for side in ("AB" if r % 2 == 0 else "BA"):
            model.native = decoders[side]
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            start = clock()
            result = engine.generate(prompt, params)
            speeds[side].append(len(result.token_ids) / (clock() - start))
            tokens.setdefault(side, result.token_ids)
    a, b = statistics.median(speeds["A"]), statistics.median(speeds["B"])
    ratios = [round(y / x, 3) for x, y in zip(speeds["A"], speeds["B"], strict=True)]
    print(f"{args.model} {args.quantization} {args.threads} thread(s), {args.context} cached tokens: "
          f"A {a:.1f}  B {b:.1f} tok/{'CPU-' if args.clock == 'cpu' else ''}s  B/A {b / a:.3f}  rounds {ratios}  same tokens: {tokens['A'] == tokens['B']}")


if __name__ == "__main__":
    main()
