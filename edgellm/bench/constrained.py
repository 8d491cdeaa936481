"""Cost of constrained decoding: `python -m edgellm.bench.constrained [MODEL] [--runs N] [--threads N]`.

Reports decode tokens/s with and without a JSON Schema constraint on the same prompt, and constrained with the loop
guard off (runs alternate; best and median), the per-token mask time (fill + apply + advance, replayed over the constrained output), and grammar
compile time cold (fresh cache) and cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np

from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams, GenerationResult
from edgellm.structured.grammar import GrammarCache, compile_format, tokenizer_info
from edgellm.structured.loop_guard import token_texts
from edgellm.structured.processor import GrammarConstraint
from edgellm.response_format import ResponseFormat

PROMPT = "Describe a customer of an online shop as JSON: name, email, age, address, and their last three orders."
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"]},
        "orders": {"type": "array", "minItems": 3, "maxItems": 3, "items": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "total": {"type": "number", "minimum": 0, "maximum": 10000},
            "status": {"enum": ["pending", "shipped", "delivered"]}}, "required": ["id", "total", "status"]}},
    },
    "required": ["name", "email", "age", "address", "orders"],
}


def _compile_times(engine: Engine, rf: ResponseFormat) -> dict[str, float]:
    vocab = engine.config.model.vocab_size
    t0 = time.perf_counter()
    info = tokenizer_info(engine.tokenizer, vocab, engine.tokenizer.stop_token_ids)
    t1 = time.perf_counter()
    cache = GrammarCache(info, threads=engine.threads)
    compile_format(cache, rf)
    t2 = time.perf_counter()
    compile_format(cache, rf)
    t3 = time.perf_counter()
    assert (cache.misses, cache.hits) == (1, 1)
    return {"tokenizer_info_ms": (t1 - t0) * 1e3, "compile_cold_ms": (t2 - t1) * 1e3,
            "compile_cached_ms": (t3 - t2) * 1e3}


def _mask_us(engine: Engine, rf: ResponseFormat, tokens: list[int]) -> float:
    """Per-token constraint cost, replayed over `tokens`: fill the mask, apply it to logits, advance the matcher."""
    vocab = engine.config.model.vocab_size
    info = tokenizer_info(engine.tokenizer, vocab, engine.tokenizer.stop_token_ids)
    compiled = compile_format(GrammarCache(info, threads=engine.threads), rf)
    assert compiled is not None
    logits = np.zeros(vocab, dtype=np.float32)
    constraint = GrammarConstraint(compiled, vocab, engine.tokenizer.stop_token_ids)
    t0 = time.perf_counter()
    for i, token in enumerate(tokens):
        constraint.process(tokens[:i], logits)
        constraint.accept(token)
    return (time.perf_counter() - t0) / max(1, len(tokens)) * 1e6


def run(model: str, *, runs: int = 3, threads: int | None = None, max_tokens: int = 160) -> dict[str, Any]:
    engine = Engine.load(model, threads=threads, progress=False)
    rf = ResponseFormat("json_schema", schema=SCHEMA)
    compile_ms = _compile_times(engine, rf)
    messages = [{"role": "user", "content": PROMPT}]
    plain = GenerationParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constrained = GenerationParams(max_tokens=max_tokens, temperature=0.0, response_format=rf)
    engine.chat(messages, GenerationParams(max_tokens=8, temperature=0.0))  # warm-up
    prompt = engine.render(messages)
    t0 = time.perf_counter()
    token_texts(engine.tokenizer, engine.config.model.vocab_size)  # the loop guard's table, once per tokenizer
    guard_table_ms = (time.perf_counter() - t0) * 1e3
    unguarded = replace(constrained, loop_guard=None)
    free_tps, json_tps, unguarded_tps, shares, guard_shares, result = [], [], [], [], [], None
    for _ in range(runs):  # alternate so that machine load hits both alike
        engine.reset()
        free_tps.append(engine.generate(prompt, plain).stats.decode_tokens_per_s)
        engine.reset()
        constraint = engine.constraint(constrained)
        assert isinstance(constraint, GrammarConstraint)  # a json_schema response format is a grammar
        chunks = list(engine._stream_guarded(prompt, constrained, constraint))
        final = chunks[-1]
        assert final.stats is not None and constraint is not None
        result = GenerationResult("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                                  final.finish_reason or "", final.stats, complete=final.complete)
        json_tps.append(final.stats.decode_tokens_per_s)
        engine.reset()
        off = engine.generate(prompt, unguarded)
        assert off.text == result.text, "the loop guard changed an output that does not loop"
        unguarded_tps.append(off.stats.decode_tokens_per_s)
        # Time inside the constraint over the whole decode, measured in the same run: robust to other load.
        shares.append(constraint.mask_s / (final.stats.decode_s + final.stats.prefill_s))
        guard_shares.append(constraint.guard_s / (final.stats.decode_s + final.stats.prefill_s))
    assert result is not None
    mask_us = _mask_us(engine, rf, result.token_ids)
    # Best-of is what the machine can do; medians show how much other load moved the numbers.
    free, constrained_tps = max(free_tps), max(json_tps)
    return {
        "model": engine.name, "threads": engine.threads, "runs": runs,
        "decode_tok_s_unconstrained": round(free, 1), "decode_tok_s_json_schema": round(constrained_tps, 1),
        "median_tok_s_unconstrained": round(statistics.median(free_tps), 1),
        "median_tok_s_json_schema": round(statistics.median(json_tps), 1),
        "decode_tok_s_json_schema_no_guard": round(max(unguarded_tps), 1),
        "median_tok_s_json_schema_no_guard": round(statistics.median(unguarded_tps), 1),
        "guard_on_over_off_median_ratio": round(statistics.median(
            on / off for on, off in zip(json_tps, unguarded_tps)), 3),
        "slowdown_pct": round((1 - constrained_tps / free) * 100, 1) if free else None,
        "mask_us_per_token": round(mask_us, 1),
        "constraint_share_of_generation_pct": round(statistics.median(shares) * 100, 2),
        "loop_guard_share_of_generation_pct": round(statistics.median(guard_shares) * 100, 3),
        "loop_guard_interventions": result.stats.guard_interventions, "loop_guard_table_ms": round(guard_table_ms, 1),
        "mask_share_of_decode_step_pct": round(mask_us / (1e6 / free) * 100, 2) if free else None,
        "constrained_tokens": len(result.token_ids), "constrained_complete": result.complete,
        **{k: round(v, 2) for k, v in compile_ms.items()},
        "output": result.text,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgellm.bench.constrained", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--runs", type=int, default=3, help="alternating runs of each kind (best and median reported)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = p.parse_args(argv)
    r = run(args.model, runs=args.runs, threads=args.threads, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(r, ensure_ascii=False))
        return 0
    print(f"model {r['model']}  threads {r['threads']}  best of {r['runs']} alternating runs (median in brackets)")
    print(f"decode unconstrained   {r['decode_tok_s_unconstrained']:8.1f} tok/s   "
          f"[{r['median_tok_s_unconstrained']:.1f}]")
    print(f"decode JSON Schema     {r['decode_tok_s_json_schema']:8.1f} tok/s   [{r['median_tok_s_json_schema']:.1f}]   "
          f"slowdown {r['slowdown_pct']:+.1f}%  ({r['constrained_tokens']} tokens, "
          f"complete={r['constrained_complete']})")
    print(f"JSON Schema, no guard  {r['decode_tok_s_json_schema_no_guard']:8.1f} tok/s   "
          f"[{r['median_tok_s_json_schema_no_guard']:.1f}]   guard on/off {r['guard_on_over_off_median_ratio']:.3f} "
          "(median of the runs' ratios; same text)")
    print(f"mask per token         {r['mask_us_per_token']:8.1f} us      "
          f"({r['mask_share_of_decode_step_pct']:.2f}% of an unconstrained decode step)")
    print(f"constraint share       {r['constraint_share_of_generation_pct']:8.2f} %       "
          "(time in mask + matcher / generation time, same runs: the slowdown it causes)")
    print(f"loop guard share       {r['loop_guard_share_of_generation_pct']:8.3f} %       "
          f"(time in the loop guard / generation time, same runs; {r['loop_guard_interventions']} interventions)")
    print(f"loop guard table       {r['loop_guard_table_ms']:8.1f} ms      (token texts, once per tokenizer)")
    print(f"tokenizer info         {r['tokenizer_info_ms']:8.1f} ms      (once per tokenizer)")
    print(f"compile cold           {r['compile_cold_ms']:8.1f} ms")
    print(f"compile cached         {r['compile_cached_ms']:8.2f} ms")
    print(f"output                 {r['output']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
