"""Lease files: which artifact folders a running server holds in memory, so `edgellm rm` can refuse to delete them.

A server writes ``<home>/leases/<pid>-<digest>.json`` when it loads a model and removes it when it unloads. A
lease names its process by pid and that process's start time (from /proc), so a lease left behind by a crashed
server is recognised as stale (the pid is gone, or belongs to a newer process) and never blocks anything.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from edgellm.paths import edgellm_home


@dataclass(frozen=True)
class Lease:
    """One loaded model of one live server process."""

    pid: int
    started: str  # the process's start time in clock ticks since boot ("" where /proc is unavailable)
    model: str
    folder: str
    expires_at: float | None  # unix time of its idle unload; None: kept until the server stops
    size_bytes: int = 0  # the planner's memory estimate


def leases_dir() -> Path:
    return edgellm_home() / "leases"


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), "" without /proc, None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int, started: str) -> bool:
    now = _start_time(pid)
    if now is None:
        return False
    if now == "" or started == "":  # no /proc: the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return now == started


def _path(folder: Path) -> Path:
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    return leases_dir() / f"{os.getpid()}-{digest}.json"


def take(model: str, folder: Path, expires_at: float | None, size_bytes: int = 0) -> None:
    """Record (or refresh) this process's lease on `folder`; written whole, then renamed into place."""
    target = _path(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    lease = {"pid": os.getpid(), "started": _start_time(os.getpid()) or "", "model": model,
             "folder": str(folder.resolve()), "expires_at": expires_at, "size_bytes": size_bytes}
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(lease), encoding="utf-8")
    os.replace(partial, target)


def release(folder: Path) -> None:
    """Drop this process's lease on `folder` (nothing if it holds none)."""
    _path(folder).unlink(missing_ok=True)


def live() -> list[Lease]:
    """The leases of running processes; stale ones (their process is gone) are deleted on the way."""
    out: list[Lease] = []
    if not leases_dir().is_dir():
        return out
    for path in sorted(leases_dir().glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            lease = Lease(int(data["pid"]), str(data["started"]), str(data["model"]), str(data["folder"]),
                          None if data["expires_at"] is None else float(data["expires_at"]),
                          int(data.get("size_bytes", 0)))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable (being replaced, or not ours): it blocks nothing
        if _alive(lease.pid, lease.started):
            out.append(lease)
        else:
            path.unlink(missing_ok=True)
    return out


def holder(folder: Path) -> Lease | None:
    """A live lease on `folder` or on a folder inside it, if any."""
    root = folder.resolve()
    for lease in live():
        held = Path(lease.folder)
        if held == root or root in held.parents:
            return lease
    return None
