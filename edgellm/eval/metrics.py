"""Pure metric functions on next-token logits, as llama.cpp's `perplexity --kl-divergence` reports them.

Conventions: `ref` and `cand` are logits (N, V) for the same N scored positions, `targets` (N,) the
token that actually came next. KL is KL(ref || cand) in nats, per position.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax in float64 (sums over 50k–150k vocabularies need it)."""
    return torch.log_softmax(logits.double(), dim=-1)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (N,) of each target token."""
    return -log_probs(logits).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """exp(mean NLL)."""
    return math.exp(nll(logits, targets).mean().item())


def kl_per_position(ref: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """KL(ref || cand) (N,) of the next-token distributions."""
    p, q = log_probs(ref), log_probs(cand)
    return (p.exp() * (p - q)).sum(-1).clamp_min(0.0)


def percentile(values: torch.Tensor, pct: float) -> float:
    """The pct-th percentile with linear interpolation (numpy's default method)."""
    return torch.quantile(values.double(), pct / 100.0).item()


def top1_agreement(ref: torch.Tensor, cand: torch.Tensor) -> float:
    """Fraction of positions where both models rank the same token first."""
    return (ref.argmax(-1) == cand.argmax(-1)).double().mean().item()


def delta_p(ref: torch.Tensor, cand: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """p_cand(correct token) - p_ref(correct token), per position (N,)."""
    idx = targets.long().unsqueeze(-1)
    return (log_probs(cand).gather(-1, idx).exp() - log_probs(ref).gather(-1, idx).exp()).squeeze(-1)


@dataclass(frozen=True)
class GapMetrics:
    """The gap between a candidate and its reference over the same scored tokens."""

    tokens: int
    ppl_ref: float
    ppl_cand: float
    ppl_ratio: float
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    delta_p_mean: float
    delta_p_rms: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def position_stats(ref: torch.Tensor, cand: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position NLLs, KL, top-1 match and Δp: small enough to keep while the logits are dropped."""
    if ref.shape != cand.shape or ref.shape[0] != targets.shape[0]:
        raise ValueError(f"shape mismatch: ref {tuple(ref.shape)}, cand {tuple(cand.shape)}, "
                         f"targets {tuple(targets.shape)}")
    return {
        "nll_ref": nll(ref, targets),
        "nll_cand": nll(cand, targets),
        "kl": kl_per_position(ref, cand),
        "same_top1": (ref.argmax(-1) == cand.argmax(-1)).double(),
        "delta_p": delta_p(ref, cand, targets),
    }


def summarize(stats: list[dict[str, torch.Tensor]]) -> GapMetrics:
    """GapMetrics over the concatenation of several `position_stats` results."""
    cat = {k: torch.cat([s[k] for s in stats]) for k in stats[0]}
    ppl_ref, ppl_cand = math.exp(cat["nll_ref"].mean().item()), math.exp(cat["nll_cand"].mean().item())
    kl, dp = cat["kl"], cat["delta_p"]
    return GapMetrics(
        tokens=int(kl.shape[0]),
        ppl_ref=ppl_ref,
        ppl_cand=ppl_cand,
        ppl_ratio=ppl_cand / ppl_ref,
        kl_mean=kl.mean().item(),
        kl_median=percentile(kl, 50),
        kl_p99=percentile(kl, 99),
        kl_max=kl.max().item(),
        top1_agreement=cat["same_top1"].mean().item(),
        delta_p_mean=dp.mean().item(),
        delta_p_rms=dp.pow(2).mean().sqrt().item(),
    )
