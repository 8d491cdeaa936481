"""`edgellm eval quality | task | gate | plot`: the argument parsing and printing of the eval verb."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError


def _say(args: argparse.Namespace):
    return (lambda msg: None) if args.quiet else (lambda msg: print(f"\r{msg[:100]:<100}", end="", file=sys.stderr,
                                                                    flush=True))


def cmd_quality(args: argparse.Namespace) -> int:
    from edgellm.eval import quality
    from edgellm.eval.report import quality_png, quality_table, write_json

    texts = [Path(t) for t in args.text] if args.text else quality.DEFAULT_CORPUS
    for t in texts:
        if not t.is_file():
            raise EdgeLLMError(f"no such text file: {t}")
    runtime = "torch" if args.per_layer else None  # attribution swaps torch modules (eval/attribution.py)
    ref = quality.open_scorer(args.reference, threads=args.threads, ctx=args.ctx, kv_cache="f32",  # full precision
                              runtime=runtime)
    cands = [quality.open_scorer(c, threads=args.threads, ctx=args.ctx, runtime=runtime) for c in args.candidates]
    result = quality.evaluate_quality(ref, cands, texts, ctx=args.ctx, max_windows=args.max_windows,
                                      progress=_say(args), path=args.path).as_dict()
    if not args.quiet:
        print(file=sys.stderr)
    print(quality_table(result))
    if args.per_layer:
        result["per_layer"] = _per_layer(args, ref, cands[0], texts)
    if args.json:
        write_json(result, args.json)
    if args.png:
        quality_png([result], args.png)
    return 0


def _per_layer(args: argparse.Namespace, ref: Any, cand: Any, texts: list[Path]) -> dict[str, Any]:
    from edgellm.eval import attribution
    from edgellm.eval.quality import windows
    from edgellm.eval.recipe import write_recipe

    if cand.engine is None:
        raise EdgeLLMError("--per-layer needs an edgellm artifact as the first candidate, not a .gguf")
    tok = ref.engine.tokenizer
    ws = [w for t in texts for w in windows(tok.encode(t.read_text(encoding="utf-8"), add_bos=False),
                                            args.layer_ctx, None)[:1]][: args.layer_windows]
    rows = attribution.attribute(ref.engine, cand.engine, ws, kl_top=args.kl_top or None, progress=_say(args))
    if not args.quiet:
        print(file=sys.stderr)
    top = sorted(rows, key=lambda r: (-1 if r["kl_gain"] is None else r["kl_gain"], r["rel_error"]),
                 reverse=True)[: args.show]
    print(f"\nmost sensitive modules of {cand.name} ({len(ws)} windows of {args.layer_ctx} tokens; KL gain = "
          "mean KL vs the reference when only that module is quantized)")
    width = max(len(r["slot"]) for r in top)
    print(f"{'module':<{width}}  format  KL gain    max rel. error  q8 cost")
    for r in top:
        gain = "   —   " if r["kl_gain"] is None else f"{r['kl_gain']:.5f}"
        print(f"{r['slot']:<{width}}  {r['format']:>6}  {gain}    {r['rel_error']:.4f}"
              f"          {r['q8_extra_bytes'] / 2**20:+.2f} MiB")
    recipe = attribution.recipe_from(rows, cand.scheme, args.keep)
    recipe["source"] = cand.name
    if args.write_recipe:
        write_recipe(args.write_recipe, **recipe)
        print(f"\nrecipe ({recipe['note']}) written to {args.write_recipe}; build it with: "
              f"edgellm convert SRC --recipe {args.write_recipe} -o DIR")
    return {"windows": len(ws), "ctx": args.layer_ctx, "modules": rows, "recipe": recipe}


def cmd_task(args: argparse.Namespace) -> int:
    from edgellm.eval import tasks
    from edgellm.eval.report import task_table, write_json
    from edgellm.runtime.engine import Engine

    items = tasks.load_dataset(args.dataset or tasks.DEFAULT_DATASET)
    if args.lang:
        items = [i for i in items if i.get("lang") == args.lang]
    if args.limit:  # an even spread over scenarios and languages, not the first N
        step = max(1, len(items) // args.limit)
        items = items[::step][: args.limit]
    if args.parallel < 1:
        raise EdgeLLMError("--parallel must be at least 1")
    engine = Engine.load(args.model, quantization=args.quantization, threads=args.threads, progress=not args.quiet,
                         sequences=args.parallel)
    report = tasks.evaluate_tasks(engine, items, args.modes.split(","), max_tokens=args.max_tokens,
                                  progress=_say(args), parallel=args.parallel)
    if not args.quiet:
        print(file=sys.stderr)
    print(task_table(report))
    if args.failures:
        for mode, m in report["modes"].items():
            for f in m["failures"][: args.failures]:
                print(f"  [{mode}] {f['id']}: {f['reason']}")
    if args.json:
        write_json(report, args.json)
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    from edgellm.eval.gate import compare, format_rows, load_report

    rows = compare(load_report(args.baseline), load_report(args.candidate), args.max_drop)
    print(format_rows(rows, args.max_drop))
    return 1 if any(r.failed for r in rows) else 0


def cmd_plot(args: argparse.Namespace) -> int:
    from edgellm.eval.gate import load_report
    from edgellm.eval.report import quality_png

    reports = [load_report(p) for p in args.reports]
    if any(r.get("kind") != "quality" for r in reports):
        raise EdgeLLMError("plot takes reports written by `edgellm eval quality --json`")
    print(quality_png(reports, args.output))
    return 0


def add_eval_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register `eval` and its subcommands on the top-level subparsers."""
    ev = sub.add_parser("eval", help="measure the accuracy gap to a reference and gate releases on it",
                        description="measure the accuracy gap to a reference and gate releases on it")
    esub = ev.add_subparsers(dest="eval_command", required=True, metavar="SUBCOMMAND")

    p = esub.add_parser("quality", parents=[common], help="perplexity, KL, top-1 and Δp of candidates vs a reference")
    p.add_argument("candidates", nargs="+", metavar="ARTIFACT", help="artifact folders, catalog names or .gguf files")
    p.add_argument("--reference", required=True, metavar="ARTIFACT", help="e.g. smollm2-135m:q0f32")
    p.add_argument("--text", nargs="+", metavar="FILE", help="texts to score (default: the built-in en/zh corpus)")
    p.add_argument("--ctx", type=int, default=512, help="window length; the second half is scored (default 512)")
    p.add_argument("--max-windows", type=int, default=None, help="at most N windows per text")
    p.add_argument("--path", choices=("prefill", "decode"), default="prefill",
                   help="how candidates compute the scored positions: prefill (their prefill chunks, default) or "
                        "decode (one token at a time, as generation does: the native decode step where it runs)")
    p.add_argument("--threads", "-t", type=int, default=None)
    p.add_argument("--json", metavar="FILE", help="write the full report")
    p.add_argument("--png", metavar="FILE", help="plot KL and top-1 vs size")
    g = p.add_argument_group("attribution")
    g.add_argument("--per-layer", action="store_true", help="rank the first candidate's modules by sensitivity")
    g.add_argument("--layer-ctx", type=int, default=256, help="tokens per attribution window (default 256)")
    g.add_argument("--layer-windows", type=int, default=2, help="attribution windows, one per text (default 2)")
    g.add_argument("--kl-top", type=int, default=12,
                   help="measure the KL gain (one forward pass each) for the N modules of largest output error "
                        "(default 12; 0 = all)")
    g.add_argument("--keep", type=int, default=8, help="modules the recipe keeps at q8 (default 8)")
    g.add_argument("--show", type=int, default=10, help="modules to list (default 10)")
    g.add_argument("--write-recipe", metavar="FILE", help="write the mixed-precision recipe for convert --recipe")
    p.set_defaults(func=cmd_quality)

    p = esub.add_parser("task", parents=[common], help="structured extraction: valid JSON / complete / correct rates")
    p.add_argument("model", metavar="ARTIFACT")
    p.add_argument("--quantization", "-q", default=None, metavar="SCHEME")
    p.add_argument("--dataset", metavar="FILE.jsonl", help="default: the built-in 100-item en/zh dataset")
    p.add_argument("--modes", default="constrained,unconstrained", help="comma-separated (default both)")
    p.add_argument("--limit", type=int, default=None, help="evaluate N items spread evenly over the dataset")
    p.add_argument("--lang", choices=["en", "zh"], default=None)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--threads", "-t", type=int, default=None)
    p.add_argument("--parallel", type=int, default=4, metavar="N",
                   help="items decoded at once, one batched step for all (default 4; greedy: the same replies)")
    p.add_argument("--failures", type=int, default=0, metavar="N", help="list up to N failures per mode")
    p.add_argument("--json", metavar="FILE", help="write the full report (input of `eval gate`)")
    p.set_defaults(func=cmd_task)

    p = esub.add_parser("gate", parents=[common], help="exit 1 if any tracked rate dropped by more than --max-drop")
    p.add_argument("--baseline", required=True, metavar="OLD.json")
    p.add_argument("--candidate", required=True, metavar="NEW.json")
    p.add_argument("--max-drop", type=float, default=5.0, help="points (default 5)")
    p.set_defaults(func=cmd_gate)

    p = esub.add_parser("plot", parents=[common], help="PNG of quality vs size from quality reports")
    p.add_argument("reports", nargs="+", metavar="REPORT.json")
    p.add_argument("--output", "-o", required=True, metavar="PNG")
    p.set_defaults(func=cmd_plot)
