"""RoPE's cos/sin tables, computed in float64 with numpy and stored as float32 (rotate-half layout: each row is
the angles of one position twice over). Torch's modules (models/blocks.py) and the native decoder
(kernels/decoder.py) read the same tables, so both paths rotate by the same bits, and a process that runs on
the native kernels alone never needs torch for them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgellm.errors import UnsupportedModelError

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeTables:
    """(length, head_dim) float32 cos/sin tables; LongRoPE adds a `long` pair that takes over for a forward whose
    last position is past `switch_at` (as Hugging Face does)."""

    cos: np.ndarray
    sin: np.ndarray
    long: tuple[np.ndarray, np.ndarray] | None = None
    switch_at: int | None = None


def rope_kind(scaling: dict[str, Any] | None) -> str:
    """The scaling type of a ModelConfig's rope_scaling (both spellings), "default" without one."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_tables(head_dim: int, theta: float, scaling: dict[str, Any] | None, length: int,
                max_position_embeddings: int) -> RopeTables:
    """The tables of `length` positions for a RoPE base `theta` and optional scaling."""
    kind = rope_kind(scaling)
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    base = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if kind == "longrope":
        short, long, factor = _longrope(base, scaling or {}, max_position_embeddings)
        return RopeTables(*_angles(short, length, factor), long=_angles(long, length, factor),
                          switch_at=int(scaling["original_max_position_embeddings"]))  # type: ignore[index]
    if kind == "linear":
        inv_freq = base / float(scaling["factor"])  # type: ignore[index]
    elif kind == "llama3":
        inv_freq = _llama3(base, scaling or {})
    else:
        inv_freq = base
    return RopeTables(*_angles(inv_freq, length, 1.0))


def _angles(inv_freq: np.ndarray, length: int, factor: float) -> tuple[np.ndarray, np.ndarray]:
    angles = np.outer(np.arange(length, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return (np.cos(angles) * factor).astype(np.float32), (np.sin(angles) * factor).astype(np.float32)


def _longrope(base: np.ndarray, scaling: dict[str, Any], max_positions: int) -> tuple[np.ndarray, np.ndarray, float]:
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("attention_factor")
    if factor is None:
        ratio = max_positions / original
        factor = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(original))
    short = base / np.asarray(scaling["short_factor"], dtype=np.float64)
    long = base / np.asarray(scaling["long_factor"], dtype=np.float64)
    return short, long, float(factor)


def _llama3(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return np.where(medium, smoothed, scaled)
