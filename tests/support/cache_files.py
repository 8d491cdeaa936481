"""Read and rewrite structured/checked_file.py's cache files, to damage them on purpose in tests."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_entry(path: Path) -> tuple[dict[str, Any], str]:
    """(header, payload) of a cache file."""
    first, _, payload = path.read_bytes().partition(b"\n")
    return json.loads(first), payload.decode("utf-8")


def write_entry(path: Path, header: dict[str, Any], payload: str, *, rehash: bool) -> None:
    """Write a cache file; with `rehash`, the header's hash and length describe the new payload (it passes them)."""
    data = payload.encode("utf-8")
    if rehash:
        header = {**header, "sha256": hashlib.sha256(data).hexdigest(), "length": len(data)}
    path.write_bytes(json.dumps(header).encode() + b"\n" + data)


def change_payload(path: Path, change: Callable[[str], str], *, rehash: bool) -> None:
    header, payload = read_entry(path)
    write_entry(path, header, change(payload), rehash=rehash)


def change_header(path: Path, name: str, value: object) -> None:
    header, payload = read_entry(path)
    write_entry(path, {**header, name: value}, payload, rehash=False)
