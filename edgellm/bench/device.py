"""Measurements behind docs/device.md: KV memory, f16 / q8 KV quality and speed, context shift, power modes.

    python -m edgellm.bench.device memory  MODEL [--contexts 512,1024,2048,4096]
    python -m edgellm.bench.device quality MODEL [--context 4096]
    python -m edgellm.bench.device reference MODEL[:SCHEME] [--context 1536]
    python -m edgellm.bench.device shift   MODEL [--window 1024]
    python -m edgellm.bench.device power   MODEL [--tokens 64 --rounds 2]
    python -m edgellm.bench.device decode  MODEL [--contexts 512,2048,4096 --tokens 32 --rounds 2]

The long text is the project's own documentation (README.md and docs/*.md), tokenized and cut to length.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

from edgellm.eval.metrics import kl_per_position, top1_agreement
from edgellm.session.context import shifted_ids
from edgellm.runtime.engine import Engine
from edgellm.bench.memory_probe import long_ids
from edgellm.generation import GenerationParams

MIB = 2**20


def kl_top1(engine_a: Engine, engine_b: Engine, ids: list[int]) -> dict[str, float]:
    """Mean/max KL(a‖b) and top-1 agreement of next-token distributions at every position, chunk by chunk."""
    kls, agree, n = [], 0, 0
    for engine in (engine_a, engine_b):
        engine.reset()
    chunk = engine_a.prefill_chunk
    for s in range(0, len(ids), chunk):
        la, lb = (torch.from_numpy(e.model.run(ids[s : s + chunk], s, e.cache, all_logits=True))
                  for e in (engine_a, engine_b))
        kls.append(kl_per_position(la, lb))
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        n += la.shape[0]
    divergence = torch.cat(kls)
    for engine in (engine_a, engine_b):
        engine.session.cached_ids = list(ids)  # the caches hold `ids` now: a later request on them reuses the prefix
    tail = divergence[len(ids) // 2 :]
    return {"positions": n, "kl_mean": float(divergence.mean()), "kl_max": float(divergence.max()),
            "kl_mean_second_half": float(tail.mean()), "top1_agreement": agree / n}


NARROW_KINDS = ("f16", "q8")  # compared with the float32 KV cache


def narrow_twins(f32: Engine) -> dict[str, Engine]:
    """`f32` and engines over the same artifact and window with each narrower KV cache (decoding natively where
    `f32` does), by kind."""
    return {"f32": f32, **{kind: Engine(f32.artifact, context_window=f32.context_window, kv_cache=kind,
                                        threads=f32.threads) for kind in NARROW_KINDS}}


def cmd_quality(args: argparse.Namespace) -> None:
    f32 = Engine.load(args.model, context_window=args.context, threads=args.threads, kv_cache="f32", progress=False)
    engines = narrow_twins(f32)
    ids = long_ids(f32, args.context)
    for kind in NARROW_KINDS:
        print(json.dumps({"model": args.model, "context": args.context, "kv": kind,
                          **kl_top1(f32, engines[kind], ids)}), flush=True)
    p = GenerationParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompt = ids[: args.context - args.tokens - 1]  # already in every cache: decode speed at a full context
    for _ in range(args.rounds):  # alternated: f32, f16, q8, f32, ...
        for name, engine in engines.items():
            r = engine.generate(prompt, p)
            print(json.dumps({"kv": name, "context_tokens": len(prompt), "decode_tok_s": round(r.stats.decode_tokens_per_s, 2),
                              "tokens": r.token_ids[:8]}), flush=True)


def cmd_reference(args: argparse.Namespace) -> None:
    """KL and top-1 of MODEL[:SCHEME] over each KV cache kind against MODEL:q0f32 over float32 (the reference),
    on `context` tokens in windows of 512 (a fresh cache per window)."""
    base = args.model.split(":")[0]
    ref = Engine.load(f"{base}:q0f32", threads=args.threads, kv_cache="f32", context_window=512, progress=False)
    ids = long_ids(ref, args.context)

    def windows(engine: Engine) -> torch.Tensor:
        rows = []
        for s in range(0, len(ids), 512):
            engine.reset()
            rows.append(engine.logits(ids[s : s + 512]).float())
        return torch.cat(rows)

    expected = windows(ref)
    for kind in ("f32", *NARROW_KINDS):
        engine = Engine.load(args.model, threads=args.threads, kv_cache=kind, context_window=512, progress=False)
        got = windows(engine)
        print(json.dumps({"model": args.model, "scheme": engine.config.quantization.scheme, "kv": kind,
                          "positions": len(ids), "kl_mean": float(kl_per_position(expected, got).mean()),
                          "top1_agreement": top1_agreement(expected, got)}), flush=True)
        engine.close()


def cmd_decode(args: argparse.Namespace) -> None:
    """Decode tok/s with the f32, f16 and q8 KV caches after about `context` tokens (the largest one less the
    tokens generated, so that they fit in the window), alternated in one process."""
    window = max(int(c) for c in args.contexts.split(","))
    contexts = [min(int(c), window - args.tokens - 1) for c in args.contexts.split(",")]
    f32 = Engine.load(args.model, context_window=window, threads=args.threads, kv_cache="f32", progress=False)
    engines = narrow_twins(f32)
    ids = long_ids(f32, max(contexts))
    p = GenerationParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for context in contexts:
        for engine in engines.values():
            engine.reset()
            engine.generate(ids[:context], GenerationParams(max_tokens=1))  # prefill, outside the timing
        best = dict.fromkeys(engines, 0.0)
        for _ in range(args.rounds):
            for name, engine in engines.items():
                r = engine.generate(ids[:context], p)  # the prompt is cached: decode only
                best[name] = max(best[name], r.stats.decode_tokens_per_s)
                print(json.dumps({"kv": name, "context": context, "decode_path": engine.decode_path,
                                  "decode_tok_s": round(r.stats.decode_tokens_per_s, 2),
                                  "load_avg": os.getloadavg()[0]}), flush=True)
        print(f"| {args.model} | {context} | " + " | ".join(f"{best[k]:.1f}" for k in engines) + " | "
              + " | ".join(f"{best[k] / best['f32']:.2f}" for k in NARROW_KINDS) + " |",
              flush=True)  # the best round of each: the least disturbed by other processes


def cmd_memory(args: argparse.Namespace) -> None:
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for kv in ("f32", *NARROW_KINDS):
            out = subprocess.run([sys.executable, "-m", "edgellm.bench.memory_probe", args.model, str(context), kv],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"| {context} | {kv} | {r['estimate_kv'] / MIB:.1f} | {r['estimate_total'] / MIB:.0f} | "
                  f"{r['rss_after_load'] / MIB:.0f} | {r['rss_peak'] / MIB:.0f} | {'yes' if r['torch_loaded'] else 'no'} |",
                  flush=True)


def cmd_shift(args: argparse.Namespace) -> None:
    """One shift each way at a full window: its time, and KL of the next token vs a fresh prefill."""
    engine = Engine.load(args.model, context_window=args.window, threads=args.threads, progress=False)
    ids = long_ids(engine, args.window + 64)
    for method in ("reencode", "rope"):
        for _ in range(args.rounds):
            engine.reset()
            seen: list[torch.Tensor] = []
            prompt = ids[: args.window - 8]

            def record(generated, logits, seen=seen):
                seen.append(logits.clone())
                return logits

            p = GenerationParams(max_tokens=16, temperature=0.0, ignore_eos=True, context_shift=method,
                                 context_keep=4, logits_processors=(record,))
            r = engine.generate(prompt, p)
            first = args.window - 1 - len(prompt)
            kept, _, _ = shifted_ids(prompt + r.token_ids[:first], args.window, 4)
            fresh = Engine(engine.artifact, context_window=args.window, threads=engine.threads)
            ref = fresh.logits(kept + [r.token_ids[first]])[-1]
            got = seen[first + 1]
            print(json.dumps({"method": method, "window": args.window, "shift_ms": round(r.stats.shift_s * 1000, 1),
                              "shifts": r.stats.context_shifts, "kl_vs_fresh": float(kl_per_position(ref, got)),
                              "same_top1": int(ref.argmax()) == int(got.argmax())}), flush=True)


def cmd_power(args: argparse.Namespace) -> None:
    engines = {mode: Engine.load(args.model, power=mode, progress=False) for mode in ("performance", "balanced", "saver")}
    prompt = long_ids(engines["performance"], 64)
    p = GenerationParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for _ in range(args.rounds):
        for mode, engine in engines.items():
            torch.set_num_threads(engine.threads)
            engine.reset()
            before = resource.getrusage(resource.RUSAGE_SELF)
            r = engine.generate(prompt, p)
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            print(json.dumps({"mode": mode, "threads": engine.threads, "decode_tok_s": round(r.stats.decode_tokens_per_s, 2),
                              "cpu_ms_per_token": round(1000 * cpu / len(r.token_ids), 1),
                              "paced_ms": round(r.stats.paced_s * 1000), "load_avg": os.getloadavg()[0]}), flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m edgellm.bench.device")
    sub = parser.add_subparsers(dest="what", required=True)
    for name, func in (("memory", cmd_memory), ("quality", cmd_quality), ("shift", cmd_shift), ("power", cmd_power),
                       ("decode", cmd_decode), ("reference", cmd_reference)):
        p = sub.add_parser(name)
        p.add_argument("model")
        p.add_argument("--contexts", default="512,1024,2048,4096")
        p.add_argument("--context", type=int, default=4096)
        p.add_argument("--window", type=int, default=1024)
        p.add_argument("--tokens", type=int, default=32)
        p.add_argument("--rounds", type=int, default=2)
        p.add_argument("--threads", type=int, default=None)
        p.set_defaults(func=func)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
