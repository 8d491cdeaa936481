"""Property-based fuzzing of every surface where outside bytes enter edgellm (issue 16).

The property everywhere: success, or a typed edgellm error / an HTTP 4xx with an OpenAI error body — never a
500, a traceback, a hang or a crash. Case counts scale with the Hypothesis profile (tests/conftest.py).
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis.errors import InvalidArgument


def examples(ci_count: int) -> int:
    """`ci_count` cases under the `ci` profile (100 max_examples), scaled up under `long`."""
    return max(1, ci_count * settings().max_examples // 100)


def tally(label: str) -> None:
    """Count `label` in Hypothesis' statistics (a no-op when called from a plain, non-Hypothesis test)."""
    try:
        event(label)
    except InvalidArgument:
        pass
