"""Cache files that are never trusted: a JSON object holding a text payload, the payload's SHA-256 and the header
fields it was written under (format, versions, key). A file whose JSON, hash or header does not match is refused
(and removed), so the caller rebuilds what it held; a file is written whole or not at all (a temporary file renamed
into place)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

MAX_FILE_BYTES = 64 << 20  # a cache file larger than this is not read


class RefusedFile(ValueError):
    """A cache file that exists but fails a check (it has been removed)."""


def read_checked(path: Path, header: dict[str, str | int]) -> str | None:
    """The payload of `path`, None when there is no such file; raises RefusedFile (after removing the file) when it
    is too large, not JSON, its payload's hash differs or a header field differs from `header`."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError("too large")
        entry = json.loads(path.read_text(encoding="utf-8"))
        payload = entry["payload"]
        if (not isinstance(payload, str) or any(entry.get(k) != v for k, v in header.items())
                or hashlib.sha256(payload.encode()).hexdigest() != entry.get("sha256")):
            raise ValueError("mismatched")
        return payload
    except OSError:  # no such file, or none that can be read (a file where the folder should be, permissions)
        return None
    except Exception as e:  # noqa: BLE001 - any damage (bad UTF-8, not an object, missing keys) means: rebuild
        discard(path)
        raise RefusedFile(f"{path.name}: {e}") from None


def discard(path: Path) -> None:
    """Remove a refused file, where the folder lets us (it is refused again on the next read otherwise)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def write_checked(path: Path, header: dict[str, str | int], payload: str) -> bool:
    """Write `payload` under `header` to `path` atomically; False (nothing written) when the folder is not writable."""
    entry = {**header, "sha256": hashlib.sha256(payload.encode()).hexdigest(), "payload": payload}
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".", suffix=".partial", dir=path.parent)
        tmp = Path(name)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            discard(tmp)
        return False


def trim_folder(folder: Path, keep: int, pattern: str = "*.json") -> None:
    """Remove the least recently written files matching `pattern` beyond the `keep` newest."""
    entries = []
    for p in folder.glob(pattern):
        try:
            entries.append((p.stat().st_mtime_ns, p))
        except FileNotFoundError:  # another process trimmed it meanwhile
            continue
    entries.sort()
    for _, stale in entries[:max(0, len(entries) - keep)]:
        discard(stale)
