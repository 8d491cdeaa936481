"""Quantization-aware tuning: train the float weights through the exact quantizer `edgellm convert` will apply.

Every weight the scheme quantizes is seen by the forward pass as ``dequantize(quantize(w))`` - the converter's own
functions, so the rounding trained against is the rounding shipped - and gradients pass straight through to ``w``
(the straight-through estimator). The converter's q4 fit searches 21 candidate ranges per group of 32, which costs
far more than the forward pass itself, so the fitted grid (each group's f16 scale and min) is kept and the weights
are rounded on it until ``refit`` asks for a fresh fit (every few steps in training, and before every measurement).
On a fresh fit the forward weight is exactly what converting gives; in between, only the grid is a few steps old.
The tuned float weights are what is saved.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize
from transformers import PreTrainedModel

from edgellm.errors import UnsupportedQuantizationError
from edgellm.quant.formats import dequantize, q4_fields, q8_fields, quantize, row_blocks
from edgellm.quant.schemes import get_scheme


Grid = tuple[torch.Tensor, torch.Tensor | None]  # per group of 32: (scale, min) as stored (min None for q8)


def _fit(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, Grid | None]:
    """The stored weight and, for q4 / q8, the grid the converter fitted for it (None: nothing to keep)."""
    try:
        parts = quantize(w, fmt)
    except UnsupportedQuantizationError:
        return w.half().to(w.dtype), None
    grid: Grid | None = None
    if fmt == "q4":
        scales, mins, _ = q4_fields(row_blocks(parts["qweight"], fmt))
        grid = (scales.float().unsqueeze(-1), mins.float().unsqueeze(-1))
    elif fmt == "q8":
        grid = (q8_fields(row_blocks(parts["qweight"], fmt))[0].float().unsqueeze(-1), None)
    return dequantize(parts, fmt).to(w.dtype), grid


def round_on_grid(w: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``w`` rounded to the nearest level of a fitted grid, as the converter rounds once it has scale and min."""
    s, m = grid
    g = w.float().view(*s.shape[:-1], -1)
    safe = torch.where(s > 0, s, 1.0)
    if m is None:  # q8: symmetric, 8 bits
        q = torch.where(s > 0, g / safe, 0.0).round_().clamp_(-127, 127)
        return (q * s).view(w.shape).to(w.dtype)
    q = torch.where(s > 0, (g - m) / safe, 0.0).round_().clamp_(0, 15)
    return (q * s + m).view(w.shape).to(w.dtype)


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


def attach(model: PreTrainedModel, scheme: str) -> int:
    """Make ``model``'s forward pass see its weights as ``scheme`` stores them; returns how many weights.

    A tied embedding and output head keep sharing one float weight (both see it quantized by their role's format,
    which the tied schemes make the same)."""
    s = get_scheme(scheme)
    count = 0
    for module, role in _roles(model):
        fmt = s.format_for(role)  # type: ignore[arg-type]
        if fmt == "f32" or parametrize.is_parametrized(module, "weight"):
            continue
        parametrize.register_parametrization(module, "weight", FakeQuant(fmt), unsafe=True)
        count += 1
    return count


def refit(model: PreTrainedModel) -> None:
    """Make every fake-quantized weight fit its grid anew (the converter's full search) at its next use."""
    for module in model.modules():
        if isinstance(module, FakeQuant):
            module.fresh = True


def detach(model: PreTrainedModel) -> None:
    """Back to plain float weights (the tuned latent ones, not their quantized image), ties restored."""
    for module, _ in _roles(model):
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
