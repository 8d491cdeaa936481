"""Context shift: when a generation fills the window, drop the oldest tokens after a kept head and go on.

Two ways, chosen per request (`GenerationParams.context_shift`):

- ``"reencode"``: the kept head plus the newest half of the window is run through the model again (the
  head's keys/values are reused). Exact: the cache is what a fresh prefill of those tokens gives.
- ``"rope"``: the newest half's keys/values move down in the cache and the keys are re-rotated by the
  distance moved (RoPE rotations compose). Only a copy, but approximate: the kept tokens' keys still carry
  what the dropped tokens contributed in earlier layers. Torch's path does it (models/rope_shift.py); a model on
  the native library alone re-encodes instead.
"""

from __future__ import annotations

from edgellm.errors import EdgeLLMError

SHIFT_METHODS = ("reencode", "rope")
DEFAULT_KEEP = 4  # tokens always kept at the start (the BOS / attention-sink tokens of a plain prompt)


def check_method(method: str) -> str:
    """`method` itself if it names a shift method; EdgeLLMError naming the known ones otherwise."""
    if method not in SHIFT_METHODS:
        raise EdgeLLMError(f"unknown context shift {method!r}; known: {', '.join(SHIFT_METHODS)}")
    return method


def shifted_ids(cached: list[int], window: int, keep: int) -> tuple[list[int], int, int]:
    """(ids kept after a shift, head length, number dropped): the head `keep` tokens and the newest half."""
    keep = max(0, min(keep, window // 2))
    drop = max(1, (len(cached) - keep) // 2)
    return cached[:keep] + cached[keep + drop :], keep, drop
