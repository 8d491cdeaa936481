"""Quantization-aware tuning: train the float weights through the exact quantizer `edgellm convert` will apply.

Every weight the scheme quantizes is seen by the forward pass as ``dequantize(quantize(w))`` - the converter's own
functions, so the rounding trained against is the rounding shipped - and gradients pass straight through to ``w``
(the straight-through estimator). The tuned float weights are what is saved: converting them with the same scheme
yields exactly the grid the tuning saw.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize
from transformers import PreTrainedModel

from edgellm.errors import UnsupportedQuantizationError
from edgellm.quant.formats import dequantize, quantize
from edgellm.quant.schemes import get_scheme


def _stored(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float weight that ``fmt`` stores for ``w``, exactly as the converter would write it."""
    try:
        return dequantize(quantize(w, fmt), fmt).to(w.dtype)
    except UnsupportedQuantizationError:  # a shape the converter keeps at f16 (see quant.formats.quantize)
        return w.half().to(w.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: the stored weight, bit for bit; backward: the gradient passes to the float weight unchanged."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, w: torch.Tensor, fmt: str) -> torch.Tensor:
        return _stored(w.detach(), fmt)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class FakeQuant(nn.Module):
    """A parametrization: the module computes with its weight as ``fmt`` stores it."""

    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.fmt = fmt

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _StraightThrough.apply(w, self.fmt)


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


def detach(model: PreTrainedModel) -> None:
    """Back to plain float weights (the tuned latent ones, not their quantized image), ties restored."""
    for module, _ in _roles(model):
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
