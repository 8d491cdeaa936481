"""Structured pruning: whole layers (depth), MLP channels and key-value groups (width), chosen by measured importance.

Only whole rows, columns and blocks go, so the pruned model is a smaller dense model of the same family that any
runtime (ours, transformers, llama.cpp) runs at full speed; unstructured sparsity would make a CPU slower.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from edgellm.compress import importance
from edgellm.compress.source import CompressError

# q4 / q8 blocks hold 32 weights along a row and 8 rows per group: a pruned width must stay a multiple of both.
WIDTH_MULTIPLE = 32
RANKS = ("influence", "kl", "angular")
# how a kept layer k takes up the dropped layers D merged into it: "sum" (LaCo) k + sum over d in D of (d - k),
# "mean" the average of k and every d in D
MERGE_RULES = ("sum", "mean")


@dataclass
class PrunePlan:
    """What to remove; layer indices are the original model's."""

    drop_layers: list[int] = field(default_factory=list)
    merge: str | None = None  # fold each dropped layer into its kept neighbour (MERGE_RULES), or None: drop only
    mlp_keep: int | None = None  # MLP channels kept in every layer (None: all)
    kv_groups_keep: int | None = None  # key-value groups kept in every layer (None: all)
    scores: dict[str, list[float]] = field(default_factory=dict)  # the measurements the plan was chosen from

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def streamed_parameters(model: PreTrainedModel) -> int:
    """Weights read for every decoded token: every linear layer and the output head, not the embedding table
    (only one of its rows is read) unless it is tied to the head."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def plan_pruning(model: PreTrainedModel, windows: torch.Tensor, *, drop_layers: int = 0, rank: str = "influence",
                 mlp_keep: int | None = None, kv_groups_keep: int | None = None,
                 merge: str | None = None) -> PrunePlan:
    """Measure importance on ``windows`` and choose what goes: the ``drop_layers`` least important layers (by block
    influence or by the KL their removal causes) or the contiguous block of that many with the smallest angular
    distance across it, and the weakest channels / groups when a width is given."""
    cfg = model.config
    n = len(importance.decoder_layers(model))
    if not 0 <= drop_layers < n:
        raise CompressError(f"can drop 0 to {n - 1} of the model's {n} layers, not {drop_layers}")
    if mlp_keep is not None and not (0 < mlp_keep <= cfg.intermediate_size and mlp_keep % WIDTH_MULTIPLE == 0):
        raise CompressError(f"--mlp-keep must be a multiple of {WIDTH_MULTIPLE} in 1..{cfg.intermediate_size}, "
                            f"got {mlp_keep}")
    if kv_groups_keep is not None and not 0 < kv_groups_keep <= cfg.num_key_value_heads:
        raise CompressError(f"--kv-groups-keep must be 1..{cfg.num_key_value_heads}, got {kv_groups_keep}")
    if rank not in RANKS:
        raise CompressError(f"--rank must be one of {', '.join(RANKS)}, not {rank!r}")
    if merge is not None and merge not in MERGE_RULES:
        raise CompressError(f"--merge must be one of {', '.join(MERGE_RULES)}, not {merge!r}")
    plan = PrunePlan(mlp_keep=mlp_keep, kv_groups_keep=kv_groups_keep, merge=merge if drop_layers else None)
    if drop_layers:
        if rank == "angular":
            scores = importance.angular_distances(model, windows, drop_layers)
            plan.scores["block_angular"] = scores  # index: the block's first layer
            start = min(range(len(scores)), key=lambda i: scores[i])
            plan.drop_layers = list(range(start, start + drop_layers))
        else:
            scores = importance.block_influence(model, windows) if rank == "influence" else \
                importance.removal_kl(model, windows)
            plan.scores[f"layer_{rank}"] = scores
            plan.drop_layers = sorted(sorted(range(n), key=lambda i: scores[i])[:drop_layers])
    return plan


def merge_targets(n: int, dropped: list[int]) -> dict[int, list[int]]:
    """Which kept layer each dropped one is merged into: the nearest kept layer below it (above it for dropped
    layers below the first kept one)."""
    kept = [i for i in range(n) if i not in set(dropped)]
    if not kept:
        raise CompressError("a merge needs at least one kept layer")
    out: dict[int, list[int]] = {}
    for d in sorted(dropped):
        below = [k for k in kept if k < d]
        out.setdefault(below[-1] if below else kept[0], []).append(d)
    return out


def merge_layers(layers: nn.ModuleList, dropped: list[int], rule: str) -> None:
    """Fold the dropped layers' parameters into their kept neighbours (merge_targets), in float64, in place."""
    if rule not in MERGE_RULES:
        raise CompressError(f"--merge must be one of {', '.join(MERGE_RULES)}, not {rule!r}")
    with torch.no_grad():
        for k, ds in merge_targets(len(layers), dropped).items():
            others = [dict(layers[d].named_parameters()) for d in ds]
            for name, p in layers[k].named_parameters():
                base = p.detach().double()
                if rule == "sum":
                    merged = base + sum(o[name].detach().double() - base for o in others)
                else:
                    merged = (base + sum(o[name].detach().double() for o in others)) / (1 + len(ds))
                p.copy_(merged.to(p.dtype))


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone())
    linear.out_features = len(rows)


def _keep_columns(linear: nn.Linear, cols: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
    linear.in_features = len(cols)


def _prune_mlp(model: PreTrainedModel, windows: torch.Tensor, keep: int) -> list[float]:
    scores = importance.mlp_channel_importance(model, windows)
    for layer, s in zip(importance.decoder_layers(model), scores):
        kept = torch.sort(torch.argsort(s, descending=True)[:keep]).values
        _keep_rows(importance.projection(layer, "mlp", "gate_proj"), kept)
        _keep_rows(importance.projection(layer, "mlp", "up_proj"), kept)
        _keep_columns(importance.projection(layer, "mlp", "down_proj"), kept)
        setattr(layer.get_submodule("mlp"), "intermediate_size", keep)  # (nn.Module's typed setattr takes modules)
    model.config.intermediate_size = keep
    return [float(s.sum()) for s in scores]


def _prune_kv_groups(model: PreTrainedModel, windows: torch.Tensor, keep: int) -> list[float]:
    cfg = model.config
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_group = heads // groups
    scores = importance.kv_group_importance(model, windows)
    for layer, s in zip(importance.decoder_layers(model), scores):
        kept = torch.sort(torch.argsort(s, descending=True)[:keep]).values
        kv_rows = (kept[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)
        q_rows = (kept[:, None] * (per_group * head_dim) + torch.arange(per_group * head_dim)).reshape(-1)
        _keep_rows(importance.projection(layer, "self_attn", "q_proj"), q_rows)
        _keep_rows(importance.projection(layer, "self_attn", "k_proj"), kv_rows)
        _keep_rows(importance.projection(layer, "self_attn", "v_proj"), kv_rows)
        _keep_columns(importance.projection(layer, "self_attn", "o_proj"), q_rows)
    cfg.head_dim = head_dim  # no longer hidden_size // heads
    cfg.num_attention_heads, cfg.num_key_value_heads = keep * per_group, keep
    return [float(s.sum()) for s in scores]


def apply_plan(model: PreTrainedModel, plan: PrunePlan, windows: torch.Tensor) -> PreTrainedModel:
    """Prune ``model`` in place as ``plan`` says (depth first, then widths, measured on the pruned model)."""
    cfg = model.config
    layers = importance.decoder_layers(model)
    if plan.drop_layers:
        gone = set(plan.drop_layers)
        if not gone <= set(range(len(layers))):
            raise CompressError(f"the plan drops layers {sorted(gone)} of a {len(layers)}-layer model")
        if plan.merge is not None:
            merge_layers(layers, plan.drop_layers, plan.merge)
        kept = [m for i, m in enumerate(layers) if i not in gone]
        for new_index, layer in enumerate(kept):
            setattr(layer.get_submodule("self_attn"), "layer_idx", new_index)
        model.model.layers = nn.ModuleList(kept)
        if isinstance(getattr(cfg, "layer_types", None), list):
            cfg.layer_types = [t for i, t in enumerate(cfg.layer_types) if i not in gone]
        cfg.num_hidden_layers = len(kept)
    if plan.mlp_keep is not None and plan.mlp_keep != cfg.intermediate_size:
        plan.scores["mlp_channels"] = _prune_mlp(model, windows, plan.mlp_keep)
    if plan.kv_groups_keep is not None and plan.kv_groups_keep != cfg.num_key_value_heads:
        plan.scores["kv_groups"] = _prune_kv_groups(model, windows, plan.kv_groups_keep)
    return model
