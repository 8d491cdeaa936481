"""session/allocator.py: glibc's thresholds are set once, and a user's own settings win."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

PROBE = """
from edgellm.session.allocator import reuse_freed_memory
print(reuse_freed_memory(), reuse_freed_memory())
"""


def _run(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120,
                          env={**clean, **env}).stdout.split()


def test_thresholds_are_set_once_unless_the_user_set_them() -> None:
    assert _run() == ["True", "True"]  # mallopt accepted both values; cached after the first call
    assert _run(MALLOC_MMAP_THRESHOLD_="131072") == ["False", "False"]
    assert _run(MALLOC_TRIM_THRESHOLD_="131072") == ["False", "False"]
