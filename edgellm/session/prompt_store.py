"""The prompt cache on disk (`--prompt-cache DIR`): one file per entry, so a restart does not pay for its prefixes again.

A file is ``<artifact key>-<token prefix digest>.kvc``: 8 magic bytes, the header's length (8 bytes, little-endian),
a JSON header (the artifact key, the cache layout, the token ids, how many came from a fresh prefill, each array's
dtype and shape, and the sha256 of the payload), then the arrays' raw bytes (C order, one after another). No pickle:
the arrays are rebuilt with numpy from the header's dtypes (float32, float16, int8 only) and shapes. A file is written
to a temporary name and renamed into place, so a crash never leaves a half-written file under a valid name. A file
whose header, layout or checksum does not match is refused with a warning and ignored; files of other artifacts
(another key prefix) are left alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from edgellm.errors import EdgeLLMError
from edgellm.models.kv_space import KVSpace
from edgellm.session.prompt_cache import CachedPrefix, PromptCache, layout_of

log = logging.getLogger("edgellm.prompt_cache")

MAGIC = b"ELKVC\x00\x00\x01"
SUFFIX = ".kvc"
MAX_HEADER_BYTES = 16 * 2**20
DTYPES = ("float32", "float16", "int8")


def artifact_key(files: dict[str, str]) -> str:
    """The identity of an artifact for its cache files: sha256 over its files' names and sha256 digests."""
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()


def prefix_digest(ids: tuple[int, ...]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()[:32]


class StoreFileError(ValueError):
    """A cache file that is not one of this artifact's (corrupted, truncated, foreign)."""


class PromptStore:
    """This artifact's cache files in `folder` (created if missing)."""

    def __init__(self, folder: str | Path, key: str, layout: dict[str, Any]) -> None:
        self.folder = Path(folder).expanduser()
        if self.folder.exists() and not self.folder.is_dir():
            raise EdgeLLMError(f"prompt cache folder {self.folder} is not a folder")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EdgeLLMError(f"prompt cache folder {self.folder}: {exc.strerror or exc}") from None
        self.key = key
        self.layout = layout

    def path(self, ids: tuple[int, ...]) -> Path:
        return self.folder / f"{self.key[:16]}-{prefix_digest(ids)}{SUFFIX}"

    def _own_files(self) -> list[Path]:
        """This artifact's files, the most recently written first."""
        files = [p for p in self.folder.glob(f"{self.key[:16]}-*{SUFFIX}") if p.is_file()]
        return sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)

    def load(self, budget_bytes: int) -> Iterator[CachedPrefix]:
        """The entries on disk, the most recent first, as many as fit in `budget_bytes`; bad files warned about."""
        total = 0
        for path in self._own_files():
            try:
                entry = self.read(path)
            except (OSError, StoreFileError) as exc:
                log.warning("prompt cache: ignoring %s: %s", path.name, exc)
                continue
            if total + entry.nbytes > budget_bytes:
                continue
            total += entry.nbytes
            yield entry

    def read(self, path: Path) -> CachedPrefix:
        """One file, checked whole: StoreFileError says what does not match."""
        data = path.read_bytes()
        if data[:8] != MAGIC or len(data) < 16:
            raise StoreFileError("not a prompt cache file")
        size = int.from_bytes(data[8:16], "little")
        if size > min(MAX_HEADER_BYTES, len(data) - 16):
            raise StoreFileError("truncated header")
        try:
            header = json.loads(data[16 : 16 + size])
            if header["artifact"] != self.key:
                raise StoreFileError("written for another artifact")
            if header["layout"] != self.layout:
                raise StoreFileError("written for another KV cache layout")
            ids = tuple(int(i) for i in header["ids"])
            prefilled = int(header["prefilled"])
            specs = [(str(d), tuple(int(n) for n in s)) for d, s in header["arrays"]]
            digest = str(header["sha256"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreFileError(f"bad header ({exc})") from None
        payload = memoryview(data)[16 + size :]
        if hashlib.sha256(payload).hexdigest() != digest:
            raise StoreFileError("checksum mismatch (the file was modified or corrupted)")
        if path.name != self.path(ids).name or not 0 <= prefilled <= len(ids):
            raise StoreFileError("header does not match the file name")
        arrays, offset = [], 0
        for (dtype, shape), (want_dtype, want_dims) in zip(specs, self.layout["arrays"], strict=True):
            if dtype not in DTYPES or dtype != want_dtype or len(shape) != 5 or \
                    list(shape[:3]) + list(shape[4:]) != want_dims or shape[3] != len(ids):
                raise StoreFileError("array shapes do not match the token ids")
            count = int(np.prod(shape))
            nbytes = count * np.dtype(dtype).itemsize
            if offset + nbytes > len(payload):
                raise StoreFileError("truncated payload")
            arrays.append(np.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(shape))
            offset += nbytes
        if offset != len(payload):
            raise StoreFileError("payload longer than its arrays")
        return CachedPrefix(ids, prefilled, tuple(arrays))

    def save(self, entry: CachedPrefix) -> None:
        """Write `entry` atomically (a temporary file renamed into place); a failure is a warning, not an error."""
        payload = [np.ascontiguousarray(a) for a in entry.arrays]
        digest = hashlib.sha256()
        for a in payload:
            digest.update(a.data)
        header = json.dumps({"artifact": self.key, "layout": self.layout, "ids": list(entry.ids),
                             "prefilled": entry.prefilled, "arrays": [[str(a.dtype), list(a.shape)] for a in payload],
                             "sha256": digest.hexdigest()}).encode()
        path = self.path(entry.ids)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + len(header).to_bytes(8, "little") + header)
                for a in payload:
                    f.write(a.data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("prompt cache: could not write %s: %s", path.name, exc.strerror or exc)
            tmp.unlink(missing_ok=True)

    def remove(self, entry: CachedPrefix) -> None:
        try:
            self.path(entry.ids).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("prompt cache: could not remove %s: %s", self.path(entry.ids).name, exc.strerror or exc)


def open_prompt_cache(budget_bytes: int, folder: str | Path | None, files: dict[str, str], cache: KVSpace) -> PromptCache:
    """A prompt cache of `budget_bytes` for `cache`'s layout, persisted in `folder` (when given) under the artifact's
    key (`files`: its files' names and sha256 digests)."""
    store = PromptStore(folder, artifact_key(files), layout_of(cache)) if folder is not None else None
    return PromptCache(budget_bytes, store=store)
