"""`edgellm compress`: argument parsing and printing."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgellm.errors import EdgeLLMError

EXAMPLES = """examples:
  # what would go, and the predicted size and speed, without writing anything
  edgellm compress smollm2-135m --drop-layers 6 --corpus notes.txt --heldout other.txt --dry-run
  # drop 6 of 30 layers, heal with 300 distillation steps, then convert the result
  edgellm compress smollm2-135m -o smol-24l --drop-layers 6 --corpus notes.txt --heldout other.txt --steps 300
  edgellm convert smol-24l -q q4f16_1e8 -o smol-24l-q4
  # tune the 4-bit scheme's group scales and mins on your own text (same size, less loss once converted)
  edgellm compress smollm2-135m -o smol-qat --qat q4f16_1 --corpus notes.txt --heldout other.txt --steps 80 --lr 2e-4
  edgellm convert smol-qat -q q4f16_1 -o smol-qat-q4

Interrupted runs (Ctrl-C, kill -9) resume from the last checkpoint when the same command is run again; the
teacher's logits, the checkpoint and the pruned starting point are kept in OUT.work/ beside the output."""


def add_compress_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("compress", parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="prune, distill and quantization-aware tuning: a smaller or better-quantizing HF model",
                       description="Prune whole layers, MLP channels or key-value groups by measured importance, "
                                   "heal the loss by distillation from the original, and tune for a quantization "
                                   "scheme; writes a Hugging Face folder that `edgellm convert` takes.",
                       epilog=EXAMPLES)
    p.add_argument("source", metavar="SRC", help="a Hugging Face folder, a .gguf file or a catalog name")
    p.add_argument("--output", "-o", metavar="DIR", help="the Hugging Face folder to write (not with --dry-run)")
    p.add_argument("--corpus", action="append", required=True, metavar="TEXT",
                   help="training / calibration text file (repeatable)")
    p.add_argument("--heldout", action="append", required=True, metavar="TEXT",
                   help="held-out text file (not in --corpus) for the KL before and after (repeatable)")
    g = p.add_argument_group("pruning")
    g.add_argument("--drop-layers", type=int, default=0, metavar="N", help="remove the N least important layers")
    g.add_argument("--rank", choices=("influence", "kl", "angular"), default="influence",
                   help="which layers go: the N of least block influence (1 - cos of a layer's input and output; "
                        "fast), of least KL when removed (one pass per layer), or angular: the contiguous block of N "
                        "whose input and output differ least in angle (arccos(cos) / pi over the calibration tokens)")
    g.add_argument("--merge", choices=("sum", "mean"), default=None,
                   help="fold each dropped layer into the nearest kept layer below it: sum (LaCo: kept + the sum "
                        "of dropped - kept) or mean (the average); the report also gives the plain drop's KL")
    g.add_argument("--mlp-keep", type=int, default=None, metavar="N",
                   help="MLP channels kept per layer (a multiple of 32), the strongest by measured contribution")
    g.add_argument("--kv-groups-keep", type=int, default=None, metavar="N",
                   help="key-value groups kept per layer (with their query heads)")
    g.add_argument("--max-windows", type=int, default=None, metavar="N",
                   help="use a seeded sample of N corpus windows, spread over the corpus (default: all); "
                        "steps x batch of them reads a large corpus once and the teacher's pass covers no more")
    g.add_argument("--calib-windows", type=int, default=16, help="corpus windows importance is measured on")
    g = p.add_argument_group("distillation and tuning")
    g.add_argument("--steps", type=int, default=0, help="optimizer steps (0: prune only)")
    g.add_argument("--qat", metavar="SCHEME", default=None,
                   help="train through this scheme's quantizer (q4f16_1, q4f16_1e8, q8f16_1)")
    g.add_argument("--qat-tune", choices=("grid", "weights"), default="grid",
                   help="with --qat, what trains: grid (default) keeps the converter's 4-/8-bit codes and trains "
                        "each group's scale and min with the norms and biases; weights trains the float weights "
                        "straight through the converter's rounding")
    g.add_argument("--qat-refit", type=int, default=None, metavar="N",
                   help="with --qat-tune weights: fit the quantization grid anew (the converter's search) every N "
                        "steps; in between the weights round on the last grid (default 10; --checkpoint-every a "
                        "multiple)")
    g.add_argument("--batch", type=int, default=8, help="windows per step over all workers (default 8)")
    g.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps per optimizer step")
    g.add_argument("--lr", type=float, default=1e-4, help="peak learning rate of AdamW (default 1e-4)")
    g.add_argument("--warmup", type=int, default=10, help="linear warm-up steps, then cosine decay")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per window (default 128)")
    g.add_argument("--top-k", type=int, default=64, help="teacher probabilities kept per position (default 64)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--checkpoint-every", type=int, default=50, metavar="N")
    g.add_argument("--freeze-below", type=int, default=0, metavar="N",
                   help="keep the embedding and the student's first N layers fixed: only the layers from N on "
                        "train, and the backward pass stops there (faster; default 0: all train)")
    g.add_argument("--hidden-weight", type=float, default=0.0, metavar="W",
                   help="add W x the hidden-state loss: each kept layer's output matched to the teacher's at the "
                        "depth it came from (the teacher runs beside the student; one worker; default 0: off)")
    g.add_argument("--workers", type=int, default=1, help="data-parallel processes on this machine (gloo)")
    p.add_argument("--dry-run", action="store_true", help="measure and print the plan; write nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_compress)


def cmd_compress(args: argparse.Namespace) -> int:
    from edgellm.compress import distill, pipeline
    from edgellm.progress import stderr_is_terminal

    if not args.dry_run and not args.output:
        raise EdgeLLMError("compress needs --output DIR (or --dry-run)")
    if args.qat_refit is not None and not (args.qat and args.qat_tune == "weights"):
        raise EdgeLLMError("--qat-refit is for --qat ... --qat-tune weights (tuning the grid fits nothing anew)")
    train = None
    if args.steps:
        train = distill.TrainConfig(steps=args.steps, batch=args.batch, accumulate=args.accumulate, lr=args.lr,
                                    warmup=args.warmup, seed=args.seed, checkpoint_every=args.checkpoint_every,
                                    freeze_below=args.freeze_below, hidden_weight=args.hidden_weight,
                                    refit_every=args.qat_refit or distill.TrainConfig.refit_every)
    opts = pipeline.CompressOptions(
        corpus=[Path(c) for c in args.corpus], heldout=[Path(h) for h in args.heldout], drop_layers=args.drop_layers,
        rank=args.rank, merge=args.merge, mlp_keep=args.mlp_keep, kv_groups_keep=args.kv_groups_keep, qat=args.qat,
        qat_tune=args.qat_tune, seq_len=args.seq_len, calib_windows=args.calib_windows, max_windows=args.max_windows,
        top_k=args.top_k, train=train, workers=args.workers)
    if args.workers < 1:
        raise EdgeLLMError("--workers must be at least 1")
    progress = not args.quiet and stderr_is_terminal()
    if args.dry_run:
        teacher, student, plan, _, held = pipeline.prepare(args.source, opts)
        from edgellm.compress.prune import streamed_parameters

        before, after = streamed_parameters(teacher.model), streamed_parameters(student)
        params_before, params_after = teacher.model.num_parameters(), student.num_parameters()
        info = {"plan": plan.as_dict(), "parameters_before": params_before, "parameters_after": params_after,
                "streamed_before": before, "streamed_after": after, "predicted_decode_speedup": before / after}
        if args.json:
            print(json.dumps(info, indent=1))
        else:
            print(f"drop layers      {plan.drop_layers or 'none'}" + (f" (merged: {plan.merge})" if plan.merge else ""))
            if "block_angular" in plan.scores:
                print(f"angular distance of the block of {args.drop_layers} starting at each layer:")
                for start, d in enumerate(plan.scores["block_angular"]):
                    print(f"  {start:3d}..{start + args.drop_layers - 1:<3d} {d:.4f}")
            print(f"parameters       {params_before / 1e6:.1f} M -> {params_after / 1e6:.1f} M")
            print(f"weights per token {before / 1e6:.1f} M -> {after / 1e6:.1f} M: decode about "
                  f"{before / after:.2f}x faster where it is bandwidth-bound")
        return 0
    report = pipeline.compress(args.source, Path(args.output), opts, progress=progress)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
        return 0
    print(f"wrote {args.output}: {report.parameters_after / 1e6:.1f} M parameters "
          f"(was {report.parameters_before / 1e6:.1f} M)", file=sys.stderr)
    trained = f", after {report.steps} steps {report.kl_after:.5f}" if report.kl_after is not None else ""
    print(f"held-out KL vs the source ({report.heldout_tokens} tokens): before {report.kl_before:.5f}{trained}",
          file=sys.stderr)
    if report.qat_groups:
        print(f"`edgellm convert -q {report.qat}` stores {report.qat_groups - (report.qat_groups_converted_otherwise or 0)}"
              f" of {report.qat_groups} tuned groups bit for bit", file=sys.stderr)
    return 0
