"""The folder a conversion writes before it is renamed into place (``.NAME.<random>.partial`` beside the output), and the
removal of those an interrupted conversion left behind.

A live conversion holds an advisory lock (``flock``) on ``.NAME.<random>.partial.lock`` from before its folder exists
until after the folder is renamed or removed; the kernel drops the lock when the process ends, however it ends.
So a partial folder whose lock file can be locked belongs to no running process, and is removed. A folder without
a lock file (written by an edgellm before these locks, or where the OS has no ``flock``) is removed only once it
has not changed for STALE_AFTER seconds: a running conversion adds a file at least once per layer.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import TracebackType

SUFFIX = ".partial"
LOCK_SUFFIX = ".lock"
STALE_AFTER = 24 * 3600.0  # seconds unchanged after which an unlocked partial folder counts as abandoned

try:
    import fcntl
except ImportError:  # no advisory locks (Windows): only the age tells
    fcntl = None  # type: ignore[assignment]


class PartialFolder:
    """A fresh, locked ``.NAME.<random>.partial`` folder beside ``out``; :meth:`close` releases the lock (the caller
    renames or removes the folder first)."""

    def __init__(self, out: Path) -> None:
        fd, lock = tempfile.mkstemp(prefix=f".{out.name}.", suffix=SUFFIX + LOCK_SUFFIX, dir=out.parent)
        self._fd, self._lock = fd, Path(lock)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            self.path = Path(lock.removesuffix(LOCK_SUFFIX))
            self.path.mkdir()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._fd >= 0:
            self._lock.unlink(missing_ok=True)
            os.close(self._fd)  # releases the lock
            self._fd = -1

    def __enter__(self) -> PartialFolder:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def remove_stale(out: Path, *, now: float | None = None) -> list[Path]:
    """Remove the partial folders (and lock files) of conversions to ``out`` that no running process is writing;
    returns the folders removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        candidates = sorted(out.parent.glob(f".{glob.escape(out.name)}.*{SUFFIX}"))
    except OSError:
        return []
    for folder in candidates:
        if folder.is_dir() and not folder.is_symlink() and _abandoned(folder, now):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    for lock in out.parent.glob(f".{glob.escape(out.name)}.*{SUFFIX}{LOCK_SUFFIX}"):
        if not lock.with_name(lock.name.removesuffix(LOCK_SUFFIX)).exists() and fcntl is not None:
            _remove_if_unlocked(lock)
    return removed


def _abandoned(folder: Path, now: float) -> bool:
    """Whether no running conversion writes ``folder`` (its lock file, when it has one, is then removed)."""
    lock = folder.with_name(folder.name + LOCK_SUFFIX)
    if fcntl is not None and lock.is_file():
        return _remove_if_unlocked(lock)
    try:
        return now - folder.stat().st_mtime > STALE_AFTER
    except OSError:
        return False


def _remove_if_unlocked(lock: Path) -> bool:
    """Unlink ``lock`` if no process holds it; whether it was free."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    lock.unlink(missing_ok=True)
    os.close(fd)
    return True
