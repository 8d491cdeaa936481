"""glibc malloc settings for an inference process: reuse freed tensor memory instead of remapping it.

glibc serves a large allocation with its own mmap and unmaps it on free, until a free of such a
block raises its threshold (up to 32 MiB). With nothing large freed at load (format 3 artifacts are
mapped, not repacked), every prefill activation of a few MiB was mapped afresh and page-faulted
page by page: SmolLM2-135M prefill ran at 670 instead of 970 tok/s on one thread. Fixing the
thresholds at glibc's own maximum keeps such blocks in the heap for reuse; peak RSS measured the
same (415 MiB either way). A user's MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ wins.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc's dynamic policy pairs with it


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (the settings below are glibc's), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@functools.cache
def reuse_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; False where it does not apply."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the OS once (after a load: the tokenizer's and the loader's
    temporaries, which the raised trim threshold would otherwise keep resident for the process's life);
    whether anything was returned. Inference keeps the thresholds: activations still reuse freed blocks."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
