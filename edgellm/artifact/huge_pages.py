"""Move the weights a decode step streams into transparent huge pages, behind a running engine.

A decode step reads every matmul weight once per token. Mapped from the artifact in 4 KiB file pages, each
page costs a TLB miss (Qwen2.5-0.5B q4 on one core: 79% of the copy-bandwidth roofline mapped, ~95% on
2 MiB pages; docs/kernels.md). Reading the shards into huge pages while loading costs the load instead: on
a VM the host backs each new page on first touch. So the load maps the shards, and a :class:`HugePageMover`
thread then copies each 2 MiB-aligned window of the streamed tensors into anonymous memory that asks for
huge pages (``MADV_HUGEPAGE``) and moves that memory over the mapped window (``mremap`` with
``MREMAP_FIXED``). The addresses never change and both copies hold the same bytes, so the engine keeps
decoding meanwhile — a read sees the file page or the huge page, never anything else — and nothing has to
be swapped or locked. A window's file pages leave the process's resident memory as it is replaced; the
extra memory at any moment is one batch of windows.

Only whole windows inside one of the artifact's own private mappings are moved: never a byte of memory
the artifact does not own. Linux only; elsewhere, with transparent huge pages "never", or after any failed
call the remaining windows simply stay mapped.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

HUGE_PAGE = 2 << 20
_BATCH_WINDOWS = 4  # windows moved per mremap where they are adjacent: 8 MiB of extra memory at most
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_NICE = 10  # the mover yields the cores to the decode threads


def unavailable_reason() -> str | None:
    """Why weights cannot be moved into huge pages here (None when they can)."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux's mremap, not {sys.platform}"
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "this kernel has no transparent huge pages"
    if "[never]" in mode:
        return "transparent huge pages are set to never"
    return None


def mapping_bounds(mm: mmap.mmap) -> tuple[int, int]:
    """The address range [start, end) of a private (copy-on-write) mapping."""
    start = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return start, start + len(mm)


def windows(tensors: Iterable[tuple[int, int]], mappings: Sequence[tuple[int, int]]) -> list[int]:
    """The start addresses, ascending, of the 2 MiB-aligned windows that hold a byte of some tensor
    ``(address, nbytes)`` and lie wholly inside one mapping ``[start, end)``."""
    found: set[int] = set()
    for address, nbytes in tensors:
        home = next(((lo, hi) for lo, hi in mappings if lo <= address and address + nbytes <= hi), None)
        if home is None or nbytes <= 0:
            continue
        first = address - address % HUGE_PAGE
        found.update(w for w in range(first, address + nbytes, HUGE_PAGE) if home[0] <= w and w + HUGE_PAGE <= home[1])
    return sorted(found)


def batches(starts: Sequence[int], most: int = _BATCH_WINDOWS) -> list[tuple[int, int]]:
    """Adjacent windows joined into ``(address, length)`` runs of at most ``most`` windows."""
    runs: list[tuple[int, int]] = []
    for w in starts:
        if runs and runs[-1][0] + runs[-1][1] == w and runs[-1][1] < most * HUGE_PAGE:
            runs[-1] = (runs[-1][0], runs[-1][1] + HUGE_PAGE)
        else:
            runs.append((w, HUGE_PAGE))
    return runs


class _Libc:
    """The three memory calls, through ctypes (each releases the GIL while it runs)."""

    FAILED = ctypes.c_void_p(-1).value

    def __init__(self) -> None:
        lib = ctypes.CDLL(None, use_errno=True)
        self.mmap, self.mremap, self.munmap, self.madvise = lib.mmap, lib.mremap, lib.munmap, lib.madvise
        self.mmap.restype = self.mremap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def move_into_huge_pages(self, address: int, length: int) -> None:
        """Replace [address, address + length) (2 MiB-aligned) by an anonymous huge-page copy of its bytes."""
        spare = length + HUGE_PAGE  # room to align the copy on a 2 MiB boundary
        raw = self.mmap(None, spare, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if raw in (None, self.FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {spare} bytes: {os.strerror(ctypes.get_errno())}")
        copy = -(-raw // HUGE_PAGE) * HUGE_PAGE
        try:
            self.madvise(copy, length, mmap.MADV_HUGEPAGE)  # a refusal only costs the speed-up
            ctypes.memmove(copy, address, length)
            if self.mremap(copy, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, address) in (None, self.FAILED):
                raise OSError(ctypes.get_errno(), f"mremap: {os.strerror(ctypes.get_errno())}")
        except BaseException:
            self.munmap(raw, spare)
            raise
        if copy > raw:  # the alignment slack either side of the moved copy
            self.munmap(raw, copy - raw)
        if raw + spare > copy + length:
            self.munmap(copy + length, raw + spare - copy - length)


class HugePageMover:
    """Moves the windows of ``spans`` ((address, bytes) of arrays viewing ``mappings``) into huge pages on a
    background thread.

    The thread holds the mappings, so they outlive it; :meth:`stop` ends it between batches.
    """

    def __init__(self, mappings: Sequence[mmap.mmap], spans: Iterable[tuple[int, int]], off: str | None = None) -> None:
        """`off`: why the weights stay mapped, when the caller already knows (then no window is even looked for)."""
        self.error: str | None = off or unavailable_reason()
        self._mappings = list(mappings) if self.error is None else []
        bounds = [mapping_bounds(mm) for mm in self._mappings if len(mm) >= HUGE_PAGE]
        self._runs = batches(windows(set(spans), bounds)) if bounds else []
        self.total_bytes = sum(n for _, n in self._runs)
        self.moved_bytes = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HugePageMover:
        if self._runs:
            self._thread = threading.Thread(target=self._run, name="edgellm-huge-pages", daemon=True)
            self._thread.start()
        else:
            self._mappings = []  # nothing to move: the mappings are the tensors' alone to keep
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if hasattr(os, "setpriority"):  # on Linux a thread's own id takes a nice value of its own
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
            libc = _Libc()
            for address, length in self._runs:
                if self._stop.is_set():
                    break
                libc.move_into_huge_pages(address, length)
                self.moved_bytes += length
        except (OSError, AttributeError) as exc:  # AttributeError: a libc without mremap
            self.error = str(exc)
        finally:
            self.seconds = time.perf_counter() - t0
            self._mappings = []

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread; True once it has finished (or never started)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def stop(self) -> None:
        """End the thread after its current batch and wait for it."""
        self._stop.set()
        self.wait()

    def describe(self) -> str:
        """One line for `info` and logs: what is in huge pages, or why not."""
        mib = f"{self.moved_bytes / 2**20:.0f} of {self.total_bytes / 2**20:.0f} MiB"
        if self.error is not None:
            return f"mapped ({self.error}; {mib} moved)" if self.moved_bytes else f"mapped ({self.error})"
        if not self.total_bytes:
            return "mapped (no 2 MiB window to move)"
        if not self.wait(0):
            return f"moving into huge pages ({mib})"
        done = "in huge pages" if self.moved_bytes == self.total_bytes else "in huge pages, stopped"
        return f"{mib} {done} ({self.seconds:.2f} s in the background)"
