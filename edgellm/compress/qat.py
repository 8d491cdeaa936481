"""Quantization-aware tuning: train through the exact quantizer `edgellm convert` will apply, in one of two ways.

``grid`` (the default): each weight's codes stay the converter's rounding, and what trains is every group's scale
(and, for q4, its min) together with every parameter the scheme stores in float (norms, biases) - the idea of
mlx-lm's DWQ. The forward pass computes with the scale and min rounded to f16 as the artifact stores them (the
gradient passes that rounding straight through), so the model trained is the model shipped. What is saved is the
dequantized weight, which lies on its tuned grid; the converter's fit finds that grid again (its plain min/max
candidate reproduces it exactly wherever a group's codes span 14 or 15 levels), and `conversion_mismatches` counts
the groups where it does not.

``weights``: every weight the scheme quantizes is seen by the forward pass as ``dequantize(quantize(w))`` - the
converter's own functions - and gradients pass straight through to the float ``w`` (the straight-through
estimator). The converter's q4 fit searches 21 candidate ranges per group of 32, which costs far more than the
forward pass itself, so the fitted grid is kept and the weights are rounded on it until ``refit`` asks for a fresh
fit (every few steps in training, and before every measurement). The tuned float weights are what is saved.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn.utils import parametrize
from transformers import PreTrainedModel

from edgellm.errors import UnsupportedQuantizationError
from edgellm.quant.formats import Parts, dequantize, q4_fields, q8_fields, quantize, row_blocks
from edgellm.quant.schemes import get_scheme


Grid = tuple[torch.Tensor, torch.Tensor | None]  # per group of 32: (scale, min) as stored (min None for q8)
TUNE_MODES = ("grid", "weights")  # what quantization-aware tuning trains (the module docstring)


def _stored_grid(parts: Parts, fmt: str) -> tuple[Grid, torch.Tensor] | None:
    """The grid and the codes ([..., groups, 32]) the converter stored in ``parts`` (None: a format without a grid)."""
    if fmt == "q4":
        scales, mins, q = q4_fields(row_blocks(parts["qweight"], fmt))
        return (scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)), q
    if fmt == "q8":
        scales, q = q8_fields(row_blocks(parts["qweight"], fmt))
        return (scales.float().unsqueeze(-1), None), q
    return None


def _fit(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, Grid | None]:
    """The stored weight and, for q4 / q8, the grid the converter fitted for it (None: nothing to keep)."""
    try:
        parts = quantize(w, fmt)
    except UnsupportedQuantizationError:
        return w.half().to(w.dtype), None
    stored = _stored_grid(parts, fmt)
    return dequantize(parts, fmt).to(w.dtype), stored[0] if stored is not None else None


def _codes(w: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The converter's codes of ``w`` on ``grid`` ([..., groups, 32]; 0..15 for q4, -127..127 for q8)."""
    s, m = grid
    g = w.float().view(*s.shape[:-1], -1)
    safe = torch.where(s > 0, s, 1.0)
    if m is None:
        return torch.where(s > 0, g / safe, 0.0).round_().clamp_(-127, 127)
    return torch.where(s > 0, (g - m) / safe, 0.0).round_().clamp_(0, 15)


def round_on_grid(w: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``w`` rounded to the nearest level of a fitted grid, as the converter rounds once it has scale and min."""
    s, m = grid
    q = _codes(w, grid)
    out = q * s if m is None else q * s + m
    return out.view(w.shape).to(w.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized weight; backward: the gradient passes to the float weight unchanged."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, w: torch.Tensor, fake: FakeQuant) -> torch.Tensor:
        return fake.quantized(w.detach())

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class FakeQuant(nn.Module):
    """A parametrization: the module computes with its weight as ``fmt`` stores it (on the last fitted grid)."""

    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.fmt = fmt
        self.grid: Grid | None = None
        self.fresh = True  # the next forward fits the grid anew

    def quantized(self, w: torch.Tensor) -> torch.Tensor:
        if self.fresh or self.grid is None:
            out, self.grid = _fit(w, self.fmt)
            self.fresh = False
            return out
        return round_on_grid(w, self.grid)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _StraightThrough.apply(w, self)


def _as_stored(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to f16 as the artifact stores it; the gradient passes the rounding straight through."""
    return x + (x.half().float() - x).detach()


class TunedGrid(nn.Module):
    """A parametrization: the weight as the converter's codes on a trained grid, ``codes * scale (+ min)``.

    ``scale = s0 (1 + scale_delta)`` and ``min = m0 + s0 min_delta`` per group, starting at the converter's fit
    (s0, m0); both train relative to the group's step, so one learning rate suits groups of any magnitude."""

    codes: torch.Tensor
    s0: torch.Tensor
    m0: torch.Tensor

    def __init__(self, w: torch.Tensor, fmt: str) -> None:
        super().__init__()
        stored = _stored_grid(quantize(w, fmt), fmt)  # UnsupportedQuantizationError: a shape fmt cannot hold
        if stored is None:
            raise ValueError(f"{fmt} has no grid to tune")
        (s, m), codes = stored
        self.register_buffer("codes", codes.clone())  # the converter's own codes, read from its blocks
        self.register_buffer("s0", s.clone())
        self.register_buffer("m0", m.clone() if m is not None else torch.zeros(0))
        self.scale_delta = nn.Parameter(torch.zeros_like(s))
        self.min_delta = nn.Parameter(torch.zeros_like(s)) if m is not None else None
        self.shape = tuple(w.shape)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        scale = _as_stored(self.s0 * (1 + self.scale_delta))
        out = self.codes.float() * scale
        if self.min_delta is not None:
            out = out + _as_stored(self.m0 + self.s0 * self.min_delta)
        return out.view(self.shape)


def _weight(module: nn.Module) -> torch.Tensor:
    return cast(torch.Tensor, module.weight)


def _roles(model: PreTrainedModel) -> list[tuple[nn.Module, str]]:
    """(module, role) for every weight the converter quantizes: block linears, the embedding, the output head."""
    out: list[tuple[nn.Module, str]] = []
    head = model.get_output_embeddings()
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and m is not head:
            out.append((m, "linear"))
    out.append((model.get_input_embeddings(), "embedding"))
    if head is not None:
        out.append((head, "lm_head"))
    return out


def attach(model: PreTrainedModel, scheme: str, tune: str = "weights") -> int:
    """Make ``model``'s forward pass see its weights as ``scheme`` stores them; returns how many weights.

    ``tune`` says what trains (TUNE_MODES). A tied embedding and output head keep sharing one float weight (both
    see it quantized by their role's format, which the tied schemes make the same) and, tuning the grid, one grid."""
    if tune not in TUNE_MODES:
        raise ValueError(f"unknown tuning mode {tune!r}; expected one of {TUNE_MODES}")
    s = get_scheme(scheme)
    count = 0
    grids: dict[int, TunedGrid] = {}
    for module, role in _roles(model):
        fmt = s.format_for(role)  # type: ignore[arg-type]
        if fmt == "f32" or parametrize.is_parametrized(module, "weight"):
            continue
        weight = _weight(module)
        if tune == "weights":
            parametrize.register_parametrization(module, "weight", FakeQuant(fmt), unsafe=True)
        else:
            try:
                grid = grids.get(id(weight)) or TunedGrid(weight.detach(), fmt)
            except (ValueError, UnsupportedQuantizationError):
                continue  # stored in float (a shape the format cannot hold): it trains as it is
            grids[id(weight)] = grid
            weight.requires_grad_(False)
            parametrize.register_parametrization(module, "weight", grid, unsafe=True)
        count += 1
    return count


def refit(model: PreTrainedModel) -> None:
    """Make every fake-quantized weight fit its grid anew (the converter's full search) at its next use."""
    for module in model.modules():
        if isinstance(module, FakeQuant):
            module.fresh = True


def detach(model: PreTrainedModel) -> None:
    """Back to plain float weights, ties restored: the tuned latent weights, or the weights on their tuned grids."""
    for module, _ in _roles(model):
        if parametrize.is_parametrized(module, "weight"):
            on_grid = isinstance(getattr(module.parametrizations, "weight")[0], TunedGrid)
            with torch.no_grad():
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=on_grid)
            _weight(module).requires_grad_(True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def conversion_mismatches(model: PreTrainedModel, scheme: str) -> tuple[int, int]:
    """(groups the converter stores differently from ``model``'s weight, all quantized groups) under ``scheme``:
    after tuning the grid, the groups where converting does not give the tuned weight back bit for bit."""
    s = get_scheme(scheme)
    differ = total = 0
    seen: set[int] = set()
    for module, role in _roles(model):
        fmt, w = s.format_for(role), _weight(module)  # type: ignore[arg-type]
        if fmt not in ("q4", "q8") or id(w) in seen:
            continue
        seen.add(id(w))
        try:
            back = dequantize(quantize(w.detach(), fmt), fmt)
        except UnsupportedQuantizationError:
            continue
        same = (back == w.detach()).view(w.shape[0], -1, 32).all(-1)
        differ, total = differ + int((~same).sum()), total + same.numel()
    return differ, total
