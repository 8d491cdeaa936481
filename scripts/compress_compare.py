"""Short healing runs of SmolLM2-135M with 6 of 30 layers dropped, one option changed at a time.

Every option takes the same number of steps on the same held-out windows; the teacher, its held-out
log-probabilities and its top-64 targets are computed once per corpus. One JSON line per option: the held-out KL
against the unpruned model before and after, and the share of the gap recovered. An option is a `+`-joined list
of: a corpus name (`prose` or `old`), a ranking (`influence`, `kl` or `angular`), a merge rule (`sum` or `mean`),
`hiddenW` (hidden-state loss of weight W), `freezeN` (--freeze-below N), `lrX` (peak learning rate X). With
`--steps 0` only the held-out KL before training is measured (no teacher targets).

    python scripts/compress_compare.py --steps 20 --prose corpus-prose.txt --old corpus-run.txt \\
        prose prose+hidden1 old prose+kl angular angular+sum
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from edgellm.compress import distill, importance, teacher_cache
from edgellm.compress.corpus import read_texts, sample_windows, token_windows
from edgellm.compress.prune import MERGE_RULES, RANKS, apply_plan, plan_pruning
from edgellm.compress.source import load_float_model

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = [ROOT / "tests/data/reference_en.txt"] + [ROOT / "edgellm/eval/data/corpus" / f for f in
                                                    ("en_declaration.txt", "en_gettysburg.txt",
                                                     "en_original_notes.txt")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("options", nargs="+")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prose", type=Path, required=True, help="the general-prose corpus")
    ap.add_argument("--old", type=Path, help="the earlier runs' corpus")
    ap.add_argument("--work", type=Path, default=Path("compare-runs"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    teacher = load_float_model("smollm2-135m")
    held = token_windows(teacher.tokenizer, read_texts(HELDOUT), 128)
    reference = importance.next_token_log_probs(teacher.model, held)
    corpora = {"prose": args.prose, "old": args.old}
    # the calibration windows (what the layers are ranked on) are the same for every option
    calib = sample_windows(token_windows(teacher.tokenizer, read_texts([args.prose]), 128), 8, 1)
    cached: dict[str, tuple[torch.Tensor, teacher_cache.TeacherTargets]] = {}
    for option in args.options:
        name, rank, weight, merge, freeze, lr = "prose", "influence", 0.0, None, 0, args.lr
        for part in option.split("+"):
            if part in corpora:
                name = part
            elif part in RANKS:
                rank = part
            elif part in MERGE_RULES:
                merge = part
            elif part.startswith("hidden"):
                weight = float(part[len("hidden"):] or 1)
            elif part.startswith("freeze"):
                freeze = int(part[len("freeze"):])
            elif part.startswith("lr"):
                lr = float(part[len("lr"):])
            else:
                raise SystemExit(f"unknown option part {part!r}")
        student = copy.deepcopy(teacher.model)
        t0 = time.monotonic()
        plan = plan_pruning(student, calib, drop_layers=6, rank=rank, merge=merge)
        apply_plan(student, plan, calib)
        before = importance.mean_kl(reference, importance.next_token_log_probs(student, held))
        row = {"option": option, "drop": plan.drop_layers, "kl_before": round(before, 4),
               "prune_s": round(time.monotonic() - t0)}
        if "block_angular" in plan.scores:
            row["block_angular"] = [round(d, 4) for d in plan.scores["block_angular"]]
        if args.steps == 0:
            print(json.dumps(row), flush=True)
            continue
        if name not in cached:
            path = corpora[name]
            if path is None:
                raise SystemExit(f"--{name} is needed for option {option}")
            windows = sample_windows(token_windows(teacher.tokenizer, read_texts([path]), 128),
                                     args.steps * args.batch, 0)
            t0 = time.monotonic()
            cached[name] = windows, teacher_cache.compute(teacher.model, windows, 64)
            print(f"# teacher on {name}: {windows.numel() / (time.monotonic() - t0):.0f} tok/s", flush=True)
        windows, targets = cached[name]
        kept = [i for i in range(len(importance.decoder_layers(teacher.model))) if i not in plan.drop_layers]
        cfg = distill.TrainConfig(steps=args.steps, batch=args.batch, lr=lr, warmup=args.warmup,
                                  checkpoint_every=args.steps, hidden_weight=weight, freeze_below=freeze)
        t0 = time.monotonic()
        log = distill.train(student, windows, targets, cfg, args.work / f"{option}-{time.time_ns()}",
                            hidden=distill.HiddenTeacher(teacher.model, kept) if weight else None)
        seconds = time.monotonic() - t0
        after = importance.mean_kl(reference, importance.next_token_log_probs(student, held))
        print(json.dumps(row | {"kl_after": round(after, 4), "recovered": round((before - after) / before, 3),
                          "train_s": round(seconds), "tok_s": round(windows[0].numel() * cfg.batch * cfg.steps
                                                                     / seconds, 1),
                          "loss_first": round(log.losses[0], 3), "loss_last": round(log.losses[-1], 3)}),
              flush=True)


if __name__ == "__main__":
    main()
