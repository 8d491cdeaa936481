"""nn.Modules over the dispatch seam: quantized linear and embedding layers, resident-memory accounting.

Modules hold only what they compute from: a QuantLinear holds its kernel's prepared state (for q4
that is the repacked weight, not the portable one), a QuantEmbedding holds the portable parts
(rows are gathered and dequantized on the fly). Tied embeddings hold both, by design. The device
is fixed at construction (no ``.to()``): build the module on the device it will run on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from edgellm.quant.dispatch import Kernel, select_kernel, state_tensors
from edgellm.quant.formats import Parts, embed_rows, storage_bytes, weight_shape


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` for a weight in any format: float32 [..., K] -> float32 [..., N]."""

    def __init__(
        self, fmt: str, kernel: Kernel, state: Any, bias: Tensor | None, shape: tuple[int, int]
    ) -> None:
        super().__init__()
        self.fmt = fmt
        self.kernel = kernel
        self.state = state
        self.out_features, self.in_features = shape
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self._matmul = kernel.matmul

    def forward(self, x: Tensor) -> Tensor:
        return self._matmul(x, self.state, self.bias)

    def resident_tensors(self) -> list[Tensor]:
        """Every tensor this layer keeps alive."""
        return state_tensors(self.state) + ([] if self.bias is None else [self.bias])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
            f"kernel={self.kernel.name}, bias={self.bias is not None}"
        )


class QuantEmbedding(nn.Module):
    """Token ids -> float32 [..., K] rows, dequantizing only the rows looked up."""

    def __init__(self, fmt: str, parts: Parts) -> None:
        super().__init__()
        self.fmt = fmt
        self.num_embeddings, self.embedding_dim = weight_shape(fmt, parts)
        self.parts = dict(parts)

    def forward(self, ids: Tensor) -> Tensor:
        return embed_rows(ids, self.parts, self.fmt)

    def resident_tensors(self) -> list[Tensor]:
        """Every tensor this layer keeps alive."""
        return list(self.parts.values())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}"


def make_linear(
    fmt: str, parts: Parts, bias: Tensor | None = None, device: torch.device | str = "cpu"
) -> QuantLinear:
    """A QuantLinear for the weight ``parts`` in ``fmt`` on ``device`` (kernel chosen by dispatch)."""
    kernel = select_kernel(fmt, device)
    shape = weight_shape(fmt, parts)
    if bias is not None and tuple(bias.shape) != (shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match N={shape[0]}")
    device = torch.device(device)
    parts = {k: v.to(device) for k, v in parts.items()}
    bias = None if bias is None else bias.to(device)
    return QuantLinear(fmt, kernel, kernel.prepare(parts), bias, shape)


def make_embedding(fmt: str, parts: Parts, device: torch.device | str = "cpu") -> QuantEmbedding:
    """A QuantEmbedding over the portable ``parts`` in ``fmt``."""
    return QuantEmbedding(fmt, {k: v.to(device) for k, v in parts.items()})


def resident_bytes(
    fmt: str,
    shape: tuple[int, int],
    matmul_only: bool = False,
    *,
    embedding: bool = False,
    device: torch.device | str = "cpu",
) -> int:
    """Bytes a loaded ``[N, K]`` weight in ``fmt`` will keep resident, computed before loading.

    Default: as a linear layer (its kernel's prepared state, e.g. f16 is held as f32).
    ``embedding=True``: as an embedding table (the portable parts, ``storage_bytes``).
    ``matmul_only=True``: what a tied lm_head adds on top of the embedding table of the same
    weight, i.e. the prepared state minus the storage it shares with the portable parts.
    Biases are not included.
    """
    if embedding:
        return storage_bytes(fmt, shape)
    kernel = select_kernel(fmt, device)
    if kernel.state_bytes is None:  # a kernel that does not say: assume a private copy
        total, shared = storage_bytes(fmt, shape), 0
    else:
        total, shared = kernel.state_bytes(*shape)
    return total - shared if matmul_only else total
