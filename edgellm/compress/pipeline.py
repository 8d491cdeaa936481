"""`compress`: prune, heal by distillation, tune for quantization - one run from a float source to an HF folder."""

from __future__ import annotations

import copy
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from edgellm.compress import distill, importance, qat, teacher_cache
from edgellm.compress.corpus import read_texts, sample_windows, token_windows
from edgellm.compress.prune import PrunePlan, apply_plan, plan_pruning, streamed_parameters
from edgellm.compress.source import CompressError, FloatModel, load_float_model

WORK_SUFFIX = ".work"  # beside the output: the teacher cache, the checkpoint, the pruned starting point


@dataclass
class CompressOptions:
    """Everything a compression run does (see `edgellm compress --help`)."""

    corpus: list[Path]
    heldout: list[Path]
    drop_layers: int = 0
    rank: str = "influence"
    merge: str | None = None  # fold the dropped layers into their kept neighbours (prune.MERGE_RULES)
    mlp_keep: int | None = None
    kv_groups_keep: int | None = None
    qat: str | None = None  # a quantization scheme to tune for (q4f16_1, ...)
    qat_tune: str = "grid"  # what the tuning trains: the groups' scales and mins, or the float weights (qat.TUNE_MODES)
    seq_len: int = 128
    calib_windows: int = 16
    max_windows: int | None = None  # train on a seeded sample of this many corpus windows (None: all)
    top_k: int = 64
    train: distill.TrainConfig | None = None  # None: no healing / tuning steps
    workers: int = 1


@dataclass
class CompressReport:
    """What the run did and measured: sizes, the plan, KL against the source before and after training."""

    source: str
    plan: dict[str, object]
    parameters_before: int
    parameters_after: int
    streamed_before: int
    streamed_after: int
    heldout_tokens: int
    kl_before: float
    kl_after: float | None = None
    kl_plain_drop: float | None = None  # with a merge: the held-out KL of the same layers dropped without it
    qat: str | None = None
    qat_tune: str | None = None
    qat_groups: int | None = None  # tuning the grid: the quantized groups, and those the converter stores otherwise
    qat_groups_converted_otherwise: int | None = None
    steps: int = 0
    losses: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def work_dir(out: Path) -> Path:
    return out.with_name(out.name + WORK_SUFFIX)


def _heldout_kl(teacher_lp: torch.Tensor, student: PreTrainedModel, windows: torch.Tensor) -> float:
    return importance.mean_kl(teacher_lp, importance.next_token_log_probs(student, windows))


def prepare(source: str | Path, opts: CompressOptions) -> tuple[FloatModel, PreTrainedModel, PrunePlan, torch.Tensor,
                                                                  torch.Tensor]:
    """The teacher, the pruned (not yet trained) student, the plan, and the training / held-out windows."""
    teacher = load_float_model(source)
    seed = opts.train.seed if opts.train is not None else 0
    train_w = sample_windows(token_windows(teacher.tokenizer, read_texts(opts.corpus), opts.seq_len),
                             opts.max_windows, seed)
    held_w = token_windows(teacher.tokenizer, read_texts(opts.heldout), opts.seq_len)
    if {tuple(r) for r in train_w.tolist()} & {tuple(r) for r in held_w.tolist()}:
        raise CompressError("the held-out text shares windows with the training corpus: give text not in --corpus")
    student = copy.deepcopy(teacher.model)
    calib = train_w[: opts.calib_windows]
    plan = plan_pruning(student, calib, drop_layers=opts.drop_layers, rank=opts.rank, mlp_keep=opts.mlp_keep,
                        kv_groups_keep=opts.kv_groups_keep, merge=opts.merge)
    apply_plan(student, plan, calib)
    return teacher, student, plan, train_w, held_w


def _train_workers(student: PreTrainedModel, windows: torch.Tensor, targets: teacher_cache.TeacherTargets,
                   cfg: distill.TrainConfig, work: Path, workers: int, progress: bool) -> distill.TrainLog:
    """The same run on ``workers`` local processes (torch.distributed over gloo); rank 0's checkpoint is the result."""
    import torch.multiprocessing as mp

    init = work / "student-init"
    student.save_pretrained(init, safe_serialization=True)
    np.save(work / "windows.npy", windows.numpy(), allow_pickle=False)
    fd, rendezvous = tempfile.mkstemp(prefix=".rendezvous-", dir=work)
    os.close(fd)
    os.unlink(rendezvous)
    mp.spawn(_worker, args=(workers, str(init), str(work), rendezvous, cfg, targets, progress), nprocs=workers,
             join=True)
    opt = distill._optimizer(student, cfg)
    return distill.load_checkpoint(work, student, opt, cfg)


def _worker(rank: int, world: int, init: str, work: str, rendezvous: str, cfg: distill.TrainConfig,
            targets: teacher_cache.TeacherTargets, progress: bool) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        student = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
        windows = torch.from_numpy(np.load(Path(work) / "windows.npy", allow_pickle=False))
        distill.train(student, windows, targets, cfg, Path(work), progress=progress)
    finally:
        dist.destroy_process_group()


def compress(source: str | Path, out: Path, opts: CompressOptions, *, progress: bool = False,
             stop_after: int | None = None) -> CompressReport:
    """Run the whole pipeline and write the student to ``out`` (a Hugging Face folder) and its report beside it.

    A run interrupted during training (kill -9 included) resumes from its last checkpoint when started again with
    the same options; ``stop_after`` ends training after that many steps (no output folder yet)."""
    out = Path(out)
    if opts.workers > 1 and opts.train is not None and (opts.train.hidden_weight > 0 or opts.qat):
        raise CompressError("the hidden-state loss and quantization-aware tuning run with one worker only")
    if opts.qat_tune not in qat.TUNE_MODES:
        raise CompressError(f"unknown tuning mode {opts.qat_tune!r}; expected one of {', '.join(qat.TUNE_MODES)}")
    refits = bool(opts.qat) and opts.qat_tune == "weights"
    if refits and opts.train is not None and opts.train.checkpoint_every % opts.train.refit_every:
        raise CompressError(f"--checkpoint-every ({opts.train.checkpoint_every}) must be a multiple of --qat-refit "
                            f"({opts.train.refit_every}), so that a resumed run fits its grid where the whole one did")
    work = work_dir(out)
    work.mkdir(parents=True, exist_ok=True)
    teacher, student, plan, train_w, held_w = prepare(source, opts)
    teacher_held = importance.next_token_log_probs(teacher.model, held_w)
    parameters_after = student.num_parameters()  # (before tuning the grid adds its scale and min deltas)
    if opts.qat:
        qat.attach(student, opts.qat, opts.qat_tune)
    report = CompressReport(
        source=str(source), plan=plan.as_dict(), parameters_before=teacher.model.num_parameters(),
        parameters_after=parameters_after, streamed_before=streamed_parameters(teacher.model),
        streamed_after=streamed_parameters(student), heldout_tokens=held_w.numel(),
        kl_before=_heldout_kl(teacher_held, student, held_w), qat=opts.qat,
        qat_tune=opts.qat_tune if opts.qat else None)
    if plan.merge is not None:
        unmerged = replace(plan, merge=None, scores=dict(plan.scores))  # (width scores of its own model)
        plain = apply_plan(copy.deepcopy(teacher.model), unmerged, train_w[: opts.calib_windows])
        report.kl_plain_drop = _heldout_kl(teacher_held, plain, held_w)
        del plain
    if opts.train is not None:
        digest = teacher_cache.weights_digest(teacher.model)
        cache_dir = work / "teacher-cache"
        targets = teacher_cache.load(cache_dir, train_w, digest, opts.top_k)
        if targets is None:
            targets = teacher_cache.compute(teacher.model, train_w, opts.top_k, progress=progress)
            teacher_cache.save(cache_dir, targets, train_w, digest)
        if opts.workers > 1:
            if stop_after is not None:
                raise CompressError("stop_after is for single-worker runs")
            log = _train_workers(student, train_w, targets, opts.train, work, opts.workers, progress)
        else:
            kept = [i for i in range(len(importance.decoder_layers(teacher.model))) if i not in plan.drop_layers]
            hidden = distill.HiddenTeacher(teacher.model, kept) if opts.train.hidden_weight > 0 else None
            every = opts.train.refit_every
            refit = (lambda step: qat.refit(student) if step % every == 0 else None) if refits else None
            log = distill.train(student, train_w, targets, opts.train, work, progress=progress, stop_after=stop_after,
                                hidden=hidden, before_step=refit)
        report.steps, report.losses = log.step, log.losses
        if log.step < opts.train.steps:
            return report
        if refits:
            qat.refit(student)  # measured on the grid the converter will fit, not the last training one
        report.kl_after = _heldout_kl(teacher_held, student, held_w)
    if opts.qat:
        qat.detach(student)
        if opts.qat_tune == "grid":
            report.qat_groups_converted_otherwise, report.qat_groups = qat.conversion_mismatches(student, opts.qat)
    FloatModel(student, teacher.tokenizer, teacher.origin).save(out)
    (out.with_name(out.name + ".report.json")).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    return report
