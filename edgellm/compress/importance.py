"""How much each layer, MLP channel and key-value group matters, measured on calibration windows."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedModel

from edgellm.compress.source import CompressError


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The model's decoder blocks (Llama-style models: ``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise CompressError(f"{type(model).__name__} has no model.layers: not a decoder this tool can prune")
    return layers


def projection(layer: nn.Module, block: str, name: str) -> nn.Linear:
    """`layer.<block>.<name>` (e.g. mlp.down_proj) of a Llama-style decoder block, checked to be a linear layer."""
    module = getattr(getattr(layer, block, None), name, None)
    if not isinstance(module, nn.Linear):
        raise CompressError(f"{type(layer).__name__} has no linear {block}.{name}: not a decoder this tool can prune")
    return module


def next_token_log_probs(model: PreTrainedModel, windows: torch.Tensor) -> torch.Tensor:
    """log softmax of the model's logits [N, T, V], float32, one window at a time."""
    with torch.no_grad():
        return torch.cat([torch.log_softmax(model(w[None]).logits.float(), -1) for w in windows])


def mean_kl(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Mean over positions of KL(reference || candidate), both log-probabilities [..., V]."""
    return float((reference.exp() * (reference - candidate)).sum(-1).mean())


def block_influence(model: PreTrainedModel, windows: torch.Tensor) -> list[float]:
    """Per layer, 1 - mean cosine similarity of the hidden state entering and leaving it (low: the layer changes
    little and is the first to drop)."""
    n = len(decoder_layers(model))
    sums = torch.zeros(n, dtype=torch.float64)
    count = 0
    for w in windows:
        states = residual_states(model, w)  # the last layer's output before the final norm, not after it
        for i in range(n):
            sums[i] += torch.cosine_similarity(states[i].double(), states[i + 1].double(), dim=-1).sum()
        count += w.numel()
    return (1.0 - sums / count).tolist()


def residual_states(model: PreTrainedModel, window: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream [T, hidden] entering each layer and leaving the last one (before the final norm)."""
    final: list[torch.Tensor] = []

    def grab(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        final.append(args[0][0])

    norm = getattr(model.model, "norm", None)
    if not isinstance(norm, nn.Module):
        raise CompressError(f"{type(model).__name__} has no model.norm: not a decoder this tool can prune")
    handle = norm.register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            hidden = model(window[None], output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    return [h[0] for h in hidden[: len(decoder_layers(model))]] + final


def angular_distances(model: PreTrainedModel, windows: torch.Tensor, block: int) -> list[float]:
    """Per start l (0 .. layers - block), the mean over tokens of arccos(cos(h_l, h_{l+block})) / pi, h_i the
    residual stream entering layer i (Gromov et al.): a small distance says layers l .. l+block-1 change little."""
    n = len(decoder_layers(model))
    if not 0 < block <= n:
        raise CompressError(f"a block of 1 to {n} layers, not {block}")
    sums = torch.zeros(n - block + 1, dtype=torch.float64)
    count = 0
    for w in windows:
        states = residual_states(model, w)
        for start in range(n - block + 1):
            cos = torch.cosine_similarity(states[start].double(), states[start + block].double(), dim=-1)
            sums[start] += (torch.arccos(cos.clamp(-1.0, 1.0)) / torch.pi).sum()
        count += w.numel()
    return (sums / count).tolist()


@contextmanager
def _without_layer(model: PreTrainedModel, index: int) -> Iterator[None]:
    layers = decoder_layers(model)
    kept = nn.ModuleList([m for i, m in enumerate(layers) if i != index])
    model.model.layers = kept
    try:
        yield
    finally:
        model.model.layers = layers


def removal_kl(model: PreTrainedModel, windows: torch.Tensor) -> list[float]:
    """Per layer, the mean KL(full || full without that layer) over the windows (slower, more direct)."""
    full = next_token_log_probs(model, windows)
    out = []
    for i in range(len(decoder_layers(model))):
        with _without_layer(model, i):
            out.append(mean_kl(full, next_token_log_probs(model, windows)))
    return out


def mlp_channel_importance(model: PreTrainedModel, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per layer [intermediate]: mean |activation| entering down_proj times the norm of its column in down_proj,
    i.e. the average size of each channel's contribution to the layer's output."""
    layers = decoder_layers(model)
    downs = [projection(m, "mlp", "down_proj") for m in layers]
    sums = [torch.zeros(down.in_features, dtype=torch.float64) for down in downs]
    def hook(i: int):
        def add(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:  # a pre-hook's return would replace args
            sums[i].add_(args[0].detach().abs().double().reshape(-1, args[0].shape[-1]).sum(0))
        return add

    _run_with_pre_hooks(model, windows, [(down, hook(i)) for i, down in enumerate(downs)])
    return [s / windows.numel() * down.weight.detach().double().norm(dim=0) for s, down in zip(sums, downs)]


def kv_group_importance(model: PreTrainedModel, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per layer [num_key_value_heads]: mean norm of the output that each key-value group's query heads add through
    o_proj (a group is removed with all of its query heads, so grouped-query attention stays valid)."""
    cfg = model.config
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_group = heads // groups
    layers = decoder_layers(model)
    sums = [torch.zeros(groups, dtype=torch.float64) for _ in layers]

    def hook(i: int, o_proj: nn.Linear):
        w = o_proj.weight.detach().double().view(o_proj.out_features, groups, per_group * head_dim)

        def add(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().double().reshape(-1, groups, per_group * head_dim)
            sums[i].add_(torch.einsum("hgd,ngd->ngh", w, x).norm(dim=-1).sum(0))
        return add

    outs = [projection(m, "self_attn", "o_proj") for m in layers]
    _run_with_pre_hooks(model, windows, [(o_proj, hook(i, o_proj)) for i, o_proj in enumerate(outs)])
    return [s / windows.numel() for s in sums]


PreHook = Callable[[nn.Module, tuple[torch.Tensor, ...]], None]


def _run_with_pre_hooks(model: PreTrainedModel, windows: torch.Tensor, hooks: list[tuple[nn.Module, PreHook]]) -> None:
    """Run the model over every window with each hook watching its module's input, then remove the hooks."""
    handles = [module.register_forward_pre_hook(fn) for module, fn in hooks]
    try:
        with torch.no_grad():
            for w in windows:
                model(w[None])
    finally:
        for h in handles:
            h.remove()
