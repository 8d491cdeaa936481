"""The building blocks every family is made of: RMSNorm, RoPE, attention, gated MLP, over quantized linears."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edgellm.errors import ArtifactError
from edgellm.models.kv_cache import KVCache
from edgellm.models.rope_tables import rope_tables
from edgellm.quant.formats import FORMAT_SUFFIXES, weight_shape
from edgellm.quant.layers import make_linear

Weights = dict[str, torch.Tensor]


class RMSNorm(nn.Module):
    """x / rms(x) · (offset + w); Gemma stores w around 0 and scales by 1 + w (offset 1)."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float() + offset, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rope(nn.Module):
    """cos/sin tables of rotate-half RoPE for every position of the context window, (length, head_dim), viewing
    models/rope_tables.py's (the native decoder reads the same arrays).

    LongRoPE keeps a second pair: a forward whose last position is past the original context uses it (as
    Hugging Face does), earlier ones the short factors."""

    short_cos: torch.Tensor  # (registered as buffers)
    short_sin: torch.Tensor
    long_cos: torch.Tensor
    long_sin: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, length: int,
                 max_position_embeddings: int) -> None:
        super().__init__()
        self.arrays = rope_tables(head_dim, theta, scaling, length, max_position_embeddings)
        self.switch_at = self.arrays.switch_at
        self._register("short", self.arrays.cos, self.arrays.sin)
        if self.arrays.long is not None:
            self._register("long", *self.arrays.long)

    def _register(self, name: str, cos: np.ndarray, sin: np.ndarray) -> None:
        self.register_buffer(f"{name}_cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer(f"{name}_sin", torch.from_numpy(sin), persistent=False)

    @property
    def length(self) -> int:
        return self.short_cos.shape[0]

    def tables(self, start: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, head_dim) for positions start..start+T."""
        use_long = self.switch_at is not None and start + t > self.switch_at
        cos, sin = (self.long_cos, self.long_sin) if use_long else (self.short_cos, self.short_sin)
        return cos[start : start + t], sin[start : start + t]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def parts(weights: Weights, prefix: str, fmt: str) -> Weights:
    """The stored pieces of one weight (e.g. q4's packed values and scales), checked to be all there."""
    if fmt not in FORMAT_SUFFIXES:
        raise ArtifactError(f"unknown weight format {fmt!r} for {prefix}")
    try:
        return {suffix: weights[f"{prefix}.{suffix}"] for suffix in FORMAT_SUFFIXES[fmt]}
    except KeyError as exc:
        raise ArtifactError(f"artifact weights lack {exc.args[0]} (format {fmt})") from None


def linear(weights: Weights, prefix: str, formats: dict[str, str]) -> nn.Module:
    return make_linear(formats[prefix], parts(weights, prefix, formats[prefix]), weights.get(f"{prefix}.bias"))


class FusedLinear(nn.Module):
    """Several projections of the same input. Same-format float weights are concatenated into one
    matmul; quantized ones (every block format) are not: the copy would sit next to the mapped rows the
    native decode step reads, doubling their resident memory."""

    def __init__(self, weights: Weights, prefixes: list[str], formats: dict[str, str]) -> None:
        super().__init__()
        fmts = {formats[p] for p in prefixes}
        biases = [weights.get(f"{p}.bias") for p in prefixes]
        present = [b for b in biases if b is not None]
        pieces = [parts(weights, p, formats[p]) for p in prefixes]
        self.sizes = [weight_shape(formats[p], pp)[0] for p, pp in zip(prefixes, pieces)]
        if len(fmts) == 1 and fmts <= {"f32", "f16"} and len(present) in (0, len(biases)):
            fused = {k: torch.cat([pp[k] for pp in pieces]) for k in pieces[0]}
            bias = torch.cat(present) if present else None
            self.linears = nn.ModuleList([make_linear(fmts.pop(), fused, bias)])
        else:
            self.linears = nn.ModuleList(make_linear(formats[p], pp, b) for p, pp, b in zip(prefixes, pieces, biases))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if len(self.linears) == 1:
            return list(self.linears[0](x).split(self.sizes, dim=-1))
        return [linear(x) for linear in self.linears]


class Attention(nn.Module):
    """Grouped-query attention over the KV cache, with optional q/k RMSNorm, sliding window and soft-capping."""

    def __init__(self, *, prefix: str, weights: Weights, formats: dict[str, str], n_heads: int, n_kv: int,
                 head_dim: int, scale: float, qk_norm: tuple[float, float] | None = None,
                 window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.scale, self.window, self.softcap = scale, window, softcap
        self.qkv = FusedLinear(weights, [f"{prefix}.{n}_proj" for n in "qkv"], formats)
        self.o_proj = linear(weights, f"{prefix}.o_proj", formats)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm is not None:  # (eps, offset)
            self.q_norm = RMSNorm(weights[f"{prefix}.q_norm.weight"], *qk_norm)
            self.k_norm = RMSNorm(weights[f"{prefix}.k_norm.weight"], *qk_norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                start: int) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotate(q.transpose(1, 2), cos, sin)  # (B, H, T, hd)
        k = rotate(k.transpose(1, 2), cos, sin)  # (B, KV, T, hd)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        keys, values = cache.update(layer, start, k, v)  # (B, KV, start+T, hd)
        mask = self._mask(start, t)
        if self.softcap is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and t > 1,
                                                 scale=self.scale, enable_gqa=True)
        else:
            out = self._capped(q, keys, values, mask if mask is not None else _causal(start, t, None), self.softcap)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def _mask(self, start: int, t: int) -> torch.Tensor | None:
        """None when plain causal attention is right (SDPA's fast paths), else the (T, S) boolean mask."""
        if self.window is not None and start + t > self.window:
            return _causal(start, t, self.window)
        if t == 1 or start == 0:
            return None
        return _causal(start, t, None)

    def _capped(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                softcap: float) -> torch.Tensor:
        group = self.n_heads // self.n_kv
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = (q @ keys.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ values


def _causal(start: int, t: int, window: int | None) -> torch.Tensor:
    """(T, start+T): query start+i sees key j when j <= start+i (and j > start+i-window)."""
    pos = torch.arange(start, start + t).unsqueeze(1)
    keys = torch.arange(start + t).unsqueeze(0)
    mask = keys <= pos
    return mask & (keys > pos - window) if window is not None else mask


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)), act SiLU or tanh-approximated GELU."""

    def __init__(self, weights: Weights, prefix: str, formats: dict[str, str], act: str) -> None:
        super().__init__()
        self.gate_up = FusedLinear(weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], formats)
        self.down_proj = linear(weights, f"{prefix}.down_proj", formats)
        self.silu = act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)  # fresh tensors (or views of one): overwritten in place, no (T, I) temporaries
        gate = F.silu(gate, inplace=True) if self.silu else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate.mul_(up))
