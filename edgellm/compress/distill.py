"""Knowledge distillation: the student learns the teacher's next-token distribution, KL(teacher || student).

The teacher's top-k probabilities are exact and the rest of its mass is one "tail" outcome, so the loss is the KL
between the two distributions coarsened the same way. AdamW with linear warm-up and cosine decay, gradient
accumulation, and a seed: the windows of step s are a function of (seed, s), so a run resumed from a checkpoint
takes the same steps the uninterrupted run would have. Checkpoints (safetensors + JSON, no pickle) are written
atomically every N steps; with several workers (torch.distributed, gloo) each takes a share of every step's
windows and gradients are averaged, so the global batch - and the result, up to summation order - is the same.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from edgellm.compress.importance import decoder_layers
from edgellm.compress.source import CompressError
from edgellm.compress.teacher_cache import TeacherTargets
from edgellm.progress import bar

CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class TrainConfig:
    """What a distillation run does; a checkpoint is only resumed by a run with the same configuration."""

    steps: int
    batch: int = 8  # windows per optimizer step, over all workers and accumulation steps
    accumulate: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup: int = 10
    seed: int = 0
    checkpoint_every: int = 50
    freeze_below: int = 0  # the embedding and the first N decoder layers stay fixed (the backward pass stops there)
    hidden_weight: float = 0.0  # weight of the hidden-state loss (0: the KL of the outputs alone)
    refit_every: int = 10  # quantization-aware tuning: steps between fits of the quantization grid

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.accumulate < 1 or self.batch % self.accumulate:
            raise CompressError(f"steps and batch must be positive and batch a multiple of accumulate: {self}")
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.warmup < 0 or self.checkpoint_every < 1:
            raise CompressError(f"lr must be positive, warmup >= 0 and checkpoint_every >= 1: {self}")
        if self.freeze_below < 0:
            raise CompressError(f"freeze_below must be >= 0: {self}")
        if self.refit_every < 1:
            raise CompressError(f"refit_every must be >= 1: {self}")
        if not (self.hidden_weight >= 0 and math.isfinite(self.hidden_weight)):
            raise CompressError(f"hidden_weight must be >= 0: {self}")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class TrainLog:
    """The loss of every step taken so far (the loss curve), and the run it belongs to."""

    config_digest: str
    step: int = 0
    losses: list[float] = field(default_factory=list)
    tokens: int = 0


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to cfg.lr over cfg.warmup steps, then cosine decay to 0 at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def step_windows(cfg: TrainConfig, step: int, n_windows: int) -> torch.Tensor:
    """The window indices of optimizer step ``step``: epochs are seeded permutations, read in order."""
    per_epoch = n_windows // cfg.batch * cfg.batch
    if per_epoch == 0:
        raise CompressError(f"batch {cfg.batch} is larger than the {n_windows} training windows")
    start = step * cfg.batch
    epoch, offset = divmod(start, per_epoch)
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
    return order[offset : offset + cfg.batch]


def kd_loss(student_logits: torch.Tensor, targets: TeacherTargets) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) on the teacher's top-k outcomes plus one tail outcome."""
    q = torch.log_softmax(student_logits.float(), -1)
    q_top = q.gather(-1, targets.token_ids)
    p_top = targets.log_probs
    p_tail = torch.log1p(-p_top.exp().sum(-1).clamp(max=1 - 1e-7))
    q_tail = torch.log1p(-q_top.exp().sum(-1).clamp(max=1 - 1e-7))
    kl = (p_top.exp() * (p_top - q_top)).sum(-1) + p_tail.exp() * (p_tail - q_tail)
    return kl.mean()


@dataclass
class HiddenTeacher:
    """The teacher run beside the student for the hidden-state loss, and which of its depths each student layer
    stands for: ``kept[j]`` is the teacher layer that student layer j was copied from."""

    model: PreTrainedModel
    kept: list[int]

    def pairs(self) -> list[tuple[int, int]]:
        """(student, teacher) indices into ``hidden_states`` of the outputs matched: every kept layer's output but
        the last one's (which the final norm and the output KL already cover)."""
        return [(j + 1, t + 1) for j, t in enumerate(self.kept[:-1])]


def hidden_loss(student_hidden: tuple[torch.Tensor, ...], teacher_hidden: tuple[torch.Tensor, ...],
                pairs: list[tuple[int, int]]) -> torch.Tensor:
    """Mean over matched layers and positions of |h_student - h_teacher|^2 / |h_teacher|^2 (the squared error
    relative to the teacher's norm at that position, so that layers with large residual norms do not dominate)."""
    terms = []
    for js, jt in pairs:
        target = teacher_hidden[jt].float()
        err = (student_hidden[js].float() - target).pow(2).sum(-1)
        terms.append((err / target.pow(2).sum(-1).clamp(min=1e-12)).mean())
    return torch.stack(terms).mean()


def freeze_lower_layers(model: PreTrainedModel, n: int) -> None:
    """Fix the input embedding (and a head tied to it) and decoder layers 0..n-1; n = 0 leaves everything trainable."""
    if n == 0:
        return
    layers = decoder_layers(model)
    if not 0 < n < len(layers):
        raise CompressError(f"--freeze-below must be 0 to {len(layers) - 1} for this {len(layers)}-layer student, "
                            f"got {n}")
    model.get_input_embeddings().requires_grad_(False)
    for layer in layers[:n]:
        layer.requires_grad_(False)


def _optimizer(model: PreTrainedModel, cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                             weight_decay=cfg.weight_decay)


def _named_trainable(model: PreTrainedModel) -> list[tuple[str, torch.nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def save_checkpoint(folder: Path, model: PreTrainedModel, opt: torch.optim.AdamW, log: TrainLog) -> None:
    """Parameters, AdamW's moments and the loss log, written beside and renamed into place."""
    target = folder / CHECKPOINT
    tmp = folder / f".{CHECKPOINT}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    params, moments = {}, {}
    for i, (name, p) in enumerate(_named_trainable(model)):
        params[name] = p.detach().contiguous()
        state = opt.state.get(p, {})
        if state:
            moments[f"{i}.exp_avg"] = state["exp_avg"].contiguous()
            moments[f"{i}.exp_avg_sq"] = state["exp_avg_sq"].contiguous()
            moments[f"{i}.step"] = torch.as_tensor(state["step"], dtype=torch.float64).reshape(1)
    save_file(params, str(tmp / "params.safetensors"))
    save_file(moments or {"empty": torch.zeros(1)}, str(tmp / "optimizer.safetensors"))
    (tmp / "log.json").write_text(json.dumps(asdict(log)) + "\n")
    old = folder / f".{CHECKPOINT}.old"
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(folder: Path, model: PreTrainedModel, opt: torch.optim.AdamW, cfg: TrainConfig) -> TrainLog:
    """Restore a checkpoint of this run into ``model`` and ``opt``; CompressError if it is another run's."""
    target = folder / CHECKPOINT
    try:
        log = TrainLog(**json.loads((target / "log.json").read_text()))
        params = load_file(str(target / "params.safetensors"))
        moments = load_file(str(target / "optimizer.safetensors"))
    except (OSError, ValueError, TypeError) as exc:
        raise CompressError(f"checkpoint in {folder} cannot be read ({exc}); remove it or use --restart") from None
    if log.config_digest != cfg.digest():
        raise CompressError(f"the checkpoint in {folder} belongs to a run with other settings; "
                            "run with the same ones to resume, or --restart")
    named = _named_trainable(model)
    if set(params) != {n for n, _ in named}:
        raise CompressError(f"the checkpoint in {folder} is for another model; remove it or use --restart")
    with torch.no_grad():
        for i, (name, p) in enumerate(named):
            p.copy_(params[name])
            if f"{i}.exp_avg" in moments:
                opt.state[p] = {"step": torch.tensor(float(moments[f"{i}.step"][0])),
                                "exp_avg": moments[f"{i}.exp_avg"].clone(),
                                "exp_avg_sq": moments[f"{i}.exp_avg_sq"].clone()}
    return log


def _sum_gradients(model: PreTrainedModel) -> None:
    """Each rank's loss is already divided by the number of workers: the sum of their gradients is the mean's."""
    for _, p in _named_trainable(model):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def train(student: PreTrainedModel, windows: torch.Tensor, targets: TeacherTargets, cfg: TrainConfig,
          out: Path, *, progress: bool = False, stop_after: int | None = None,
          on_step: Callable[[int, float], None] | None = None, hidden: HiddenTeacher | None = None,
          before_step: Callable[[int], None] | None = None) -> TrainLog:
    """Distill into ``student`` (in place) for cfg.steps optimizer steps, resuming ``out``'s checkpoint if any.

    With cfg.hidden_weight > 0, ``hidden`` (the teacher and the layer map) adds the hidden-state loss; the teacher
    then runs forward beside the student on every window. Under torch.distributed each rank computes its share of
    every step; rank 0 writes checkpoints. ``before_step(step)`` runs before each step's forward passes.
    ``stop_after`` ends the run after that many steps of this call (a test's stand-in for an interruption).
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if cfg.batch % (cfg.accumulate * world):
        raise CompressError(f"batch {cfg.batch} must split evenly over {world} workers x {cfg.accumulate} "
                            "accumulation steps")
    if cfg.hidden_weight > 0:
        if hidden is None:
            raise CompressError("the hidden-state loss needs the teacher beside the student")
        if len(hidden.kept) != len(decoder_layers(student)):
            raise CompressError(f"the layer map names {len(hidden.kept)} layers, the student has "
                                f"{len(decoder_layers(student))}")
    pairs = hidden.pairs() if hidden is not None and cfg.hidden_weight > 0 else []
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    freeze_lower_layers(student, cfg.freeze_below)
    student.train()
    opt = _optimizer(student, cfg)
    log = load_checkpoint(out, student, opt, cfg) if (out / CHECKPOINT).is_dir() else TrainLog(cfg.digest())
    micro = cfg.batch // (cfg.accumulate * world)
    steps = bar(range(log.step, cfg.steps), enabled=progress and rank == 0, desc="distilling", unit="step",
                initial=log.step, total=cfg.steps)
    t0, tokens0, first = time.monotonic(), log.tokens, log.step
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        if before_step is not None:
            before_step(step)
        mine = step_windows(cfg, step, len(windows)).view(world, cfg.accumulate, micro)[rank]
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for ids in mine:
            t = TeacherTargets(targets.log_probs[ids], targets.token_ids[ids])
            result = student(windows[ids], output_hidden_states=bool(pairs))
            loss = kd_loss(result.logits, t)
            if pairs and hidden is not None:
                with torch.no_grad():
                    teacher_hidden = hidden.model(windows[ids], output_hidden_states=True).hidden_states
                loss = loss + cfg.hidden_weight * hidden_loss(result.hidden_states, teacher_hidden, pairs)
            loss = loss / (cfg.accumulate * world)
            loss.backward()
            total += float(loss.detach())
        if world > 1:
            _sum_gradients(student)
            summed = torch.tensor([total])
            dist.all_reduce(summed)
            total = float(summed[0])
        opt.step()
        log.step, log.tokens = step + 1, log.tokens + windows[0].numel() * cfg.batch
        log.losses.append(total)
        if progress and rank == 0:
            rate = (log.tokens - tokens0) / max(1e-9, time.monotonic() - t0)
            steps.set_postfix(loss=f"{total:.4f}", tok_s=f"{rate:.0f}")
        if on_step is not None:
            on_step(log.step, total)
        if rank == 0 and (log.step % cfg.checkpoint_every == 0 or log.step == cfg.steps):
            save_checkpoint(out, student, opt, log)
        if stop_after is not None and log.step - first >= stop_after:
            break
    student.eval()
    return log
