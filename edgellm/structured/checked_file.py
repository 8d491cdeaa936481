"""Cache files that are never trusted: one line of JSON (the header fields the file was written under: format,
versions, key; the payload's SHA-256 and length), then the text payload itself (not escaped into JSON: a
tokenizer's is megabytes). A file whose header, length or hash does not match is refused (and removed), so the
caller rebuilds what it held; a file is written whole or not at all (a temporary file renamed into place)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

MAX_FILE_BYTES = 64 << 20  # a cache file larger than this is not read
SUFFIX = ".cache"  # the files' names end so (not .json: only their first line is JSON)


class RefusedFile(ValueError):
    """A cache file that exists but fails a check (it has been removed)."""


def read_checked(path: Path, header: dict[str, str | int]) -> str | None:
    """The payload of `path`, None when there is no such file; raises RefusedFile (after removing the file) when it
    is too large, its header is not JSON or differs from `header`, or its payload's length or hash differs."""
    try:
        too_large = path.stat().st_size > MAX_FILE_BYTES
        data = b"" if too_large else path.read_bytes()
    except OSError:  # no such file, or none that can be read (a file where the folder should be, permissions)
        return None
    try:
        if too_large:
            raise ValueError("too large")
        first, _, payload = data.partition(b"\n")
        entry = json.loads(first)
        if (not isinstance(entry, dict) or any(entry.get(k) != v for k, v in header.items())
                or entry.get("length") != len(payload) or hashlib.sha256(payload).hexdigest() != entry.get("sha256")):
            raise ValueError("mismatched")
        return payload.decode("utf-8")
    except ValueError as e:  # not JSON, not UTF-8, a header or hash that differs: rebuild
        discard(path)
        raise RefusedFile(f"{path.name}: {e}") from None


def discard(path: Path) -> None:
    """Remove a refused file, where the folder lets us (it is refused again on the next read otherwise)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def write_checked(path: Path, header: dict[str, str | int], payload: str) -> bool:
    """Write `payload` under `header` to `path` atomically; False (nothing written) when the folder is not writable."""
    data = payload.encode("utf-8")
    entry = {**header, "sha256": hashlib.sha256(data).hexdigest(), "length": len(data)}
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".", suffix=".partial", dir=path.parent)
        tmp = Path(name)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(entry).encode() + b"\n" + data)
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            discard(tmp)
        return False


def trim_folder(folder: Path, keep: int, patterns: tuple[str, ...] = (f"*{SUFFIX}",)) -> None:
    """Remove the least recently written files matching `patterns` beyond the `keep` newest."""
    entries = []
    for p in (p for pattern in patterns for p in folder.glob(pattern)):
        try:
            entries.append((p.stat().st_mtime_ns, p))
        except FileNotFoundError:  # another process trimmed it meanwhile
            continue
    entries.sort()
    for _, stale in entries[:max(0, len(entries) - keep)]:
        discard(stale)
