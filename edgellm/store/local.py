"""The versioned model store under ``$EDGELLM_HOME/store``.

Layout::

    store/blobs/sha256/<hex>            every file once, by content hash (read-only)
    store/models/<NAME>/versions/<V>/   one folder per version: hard links to blobs, opened like any artifact
    store/models/<NAME>/refs.json       {"current": V, "previous": V, "channel": ..., "key": PINNED_KEY,
                                         "releases": {V: {"published": ..., "sequence": N}}}, replaced atomically
    store/channels.json                 the newest signed index seen per channel (see freshness.py)
    store/tmp/                          staging folders and partial downloads (resumable)

A version folder appears only once complete and verified (staged in tmp/, then renamed); versions
never change afterwards. Switching versions rewrites ``refs.json`` with one ``os.replace``.

Two locks: ``locked()`` (exclusive, held only for short switches: a commit, activate, rollback, gc) and
``fetching()`` (shared, held by updates and repairs while they download and stage; gc needs it exclusively,
so it never deletes a download in flight). A download never holds ``locked()``, so rollback never waits on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edgellm.artifact.config import MANIFEST_FILE
from edgellm.artifact.manifest import FileEntry, Manifest, sha256_file
from edgellm.artifact.reader import open_artifact
from edgellm.errors import ArtifactError, EdgeLLMError, ModelNotFoundError
from edgellm.paths import edgellm_home

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class StoreError(EdgeLLMError):
    """A store operation that cannot be done (unknown name or version, refused switch)."""


def check_name(value: str, what: str) -> str:
    """A model name or version: letters, digits, '.', '_', '+', '-' (no '/', '@', ':'), at most 64 characters."""
    if not _NAME.match(value) or value in (".", ".."):
        raise StoreError(f"invalid {what} {value!r}: use letters, digits, '.', '_', '+', '-' (at most 64)")
    return value


def check_sha256(value: str) -> str:
    if not isinstance(value, str) or not _SHA256.match(value):
        raise StoreError(f"invalid sha256 {value!r}")
    return value


def split_ref(ref: str) -> tuple[str, str | None]:
    """``NAME@VERSION`` → (NAME, VERSION); ``NAME`` → (NAME, None)."""
    name, sep, version = ref.partition("@")
    return name, (version if sep else None)


def release_files(folder: Path) -> dict[str, FileEntry]:
    """Every file of an artifact folder by name, manifest.json included (what a version is made of)."""
    manifest = Manifest.read(folder)
    files = dict(manifest.files)
    path = folder / MANIFEST_FILE
    files[MANIFEST_FILE] = FileEntry(sha256_file(path), path.stat().st_size)
    return files


@dataclass(frozen=True, order=True)
class ReleaseStamp:
    """Where a release sits in its publisher's order: the signed publish time, then the index sequence it was
    published in (0 when the index has none)."""

    published: str
    sequence: int = 0


@dataclass(frozen=True)
class Refs:
    current: str | None = None
    previous: str | None = None
    channel: str | None = None
    key: str | None = None  # the public key pinned for this model: the one that signed its first channel install
    releases: dict[str, ReleaseStamp] = field(default_factory=dict)  # versions installed from a channel


@dataclass(frozen=True)
class StoredVersion:
    name: str
    version: str
    folder: Path
    files: dict[str, FileEntry]

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())


class Store:
    """Names → immutable versions → content-addressed files."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or edgellm_home() / "store"
        self.blobs = self.root / "blobs" / "sha256"
        self.models = self.root / "models"
        self.tmp = self.root / "tmp"

    # ---- reading -----------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        if not self.models.is_dir():
            return []
        return sorted(p.name for p in self.models.iterdir() if (p / "versions").is_dir() and _NAME.match(p.name))

    def versions(self, name: str) -> list[str]:
        """Installed versions, oldest first."""
        folder = self.models / name / "versions"
        if not folder.is_dir():
            return []
        found = [p for p in folder.iterdir() if p.is_dir() and _NAME.match(p.name)]
        return [p.name for p in sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))]

    def refs(self, name: str) -> Refs:
        path = self.models / name / "refs.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            releases = {v: ReleaseStamp(str(r["published"]), int(r.get("sequence", 0)))
                        for v, r in raw.get("releases", {}).items()}
            return Refs(raw.get("current"), raw.get("previous"), raw.get("channel"), raw.get("key"), releases)
        except FileNotFoundError:
            return Refs()
        except (OSError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{path} is unreadable ({exc}); `edgellm store activate {name} VERSION` "
                             "rewrites it") from None

    def version_dir(self, name: str, version: str) -> Path:
        return self.models / check_name(name, "model name") / "versions" / check_name(version, "version")

    def get(self, name: str, version: str) -> StoredVersion:
        folder = self.version_dir(name, version)
        if not folder.is_dir():
            have = ", ".join(self.versions(name)) or "none"
            raise ModelNotFoundError(f"{name} has no version {version!r} in the store (installed: {have})")
        return StoredVersion(name, version, folder, release_files(folder))

    def find(self, ref: str) -> Path | None:
        """The folder for ``NAME`` (its current version) or ``NAME@VERSION``; None if NAME is not stored."""
        name, version = split_ref(ref)
        if not _NAME.match(name) or name not in self.names():
            if version is not None:
                raise ModelNotFoundError(f"no model {name!r} in the store ({self.root}); `edgellm store list` shows them")
            return None
        if version is None:
            version = self.refs(name).current
            if version is None:
                raise StoreError(f"{name} has no current version; `edgellm store activate {name} VERSION`")
        return self.get(name, version).folder

    def has_blob(self, sha256: str) -> bool:
        return (self.blobs / check_sha256(sha256)).is_file()

    # ---- writing -----------------------------------------------------------------------------------------
    def locked(self) -> contextlib.AbstractContextManager[None]:
        """One writer at a time for the short switches (commit, activate, rollback, gc); never held while
        anything is downloaded."""
        return _flock(self.root, ".lock", exclusive=True)

    def fetching(self) -> contextlib.AbstractContextManager[None]:
        """Held (shared) by an update or repair from its first download to its commit; gc refuses while any
        holds it, so it never deletes a download in flight."""
        return _flock(self.root, ".fetch-lock", exclusive=False)

    def put_blob(self, src: Path, entry: FileEntry) -> None:
        """Copy ``src`` into the blob store if its hash is new; ArtifactError if it does not match ``entry``."""
        if self.has_blob(entry.sha256):
            return
        self.tmp.mkdir(parents=True, exist_ok=True)
        part = self.tmp / f"{entry.sha256}.{secrets.token_hex(4)}.copy"
        try:
            shutil.copyfile(src, part)
            self.adopt_blob(part, entry)
        finally:
            part.unlink(missing_ok=True)

    def adopt_blob(self, part: Path, entry: FileEntry) -> None:
        """Move a finished file into the blob store after checking its size and sha256."""
        size = part.stat().st_size
        if size != entry.size:
            raise ArtifactError(f"file {entry.sha256[:12]} is {size} bytes, expected {entry.size}")
        if sha256_file(part) != entry.sha256:
            raise ArtifactError(f"file {entry.sha256[:12]} fails its sha256 check: tampered with or corrupted")
        part.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        self.blobs.mkdir(parents=True, exist_ok=True)
        os.replace(part, self.blobs / entry.sha256)

    def relink(self, folder: Path, member: str, sha256: str) -> None:
        """Point ``folder/member`` at the blob ``sha256`` again, atomically (a repair after damage)."""
        tmp = folder / f".{_safe_member(member)}.{secrets.token_hex(4)}.tmp"
        _link_or_copy(self.blobs / check_sha256(sha256), tmp)
        os.replace(tmp, folder / member)

    def stage(self, files: dict[str, FileEntry]) -> Path:
        """A temporary artifact folder linking the blobs of ``files``, fully verified; the caller renames it."""
        missing = [n for n, e in files.items() if not self.has_blob(e.sha256)]
        if missing:
            raise StoreError(f"the store lacks {len(missing)} files of this version, e.g. {missing[0]}")
        self.tmp.mkdir(parents=True, exist_ok=True)
        folder = self.tmp / f"stage-{secrets.token_hex(6)}"
        folder.mkdir()
        try:
            for name, entry in files.items():
                _link_or_copy(self.blobs / entry.sha256, folder / _safe_member(name))
            got = release_files(folder)
            if got != files:
                raise ArtifactError("the version's manifest.json does not list the same files as its release")
            open_artifact(folder, verify=True)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    def commit(self, staged: Path, name: str, version: str) -> StoredVersion:
        """Rename a staged folder into place as NAME@VERSION (which must not exist yet)."""
        target = self.version_dir(name, version)
        if target.exists():
            shutil.rmtree(staged, ignore_errors=True)
            raise StoreError(f"{name}@{version} is already installed; versions never change (pick a new version)")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staged, target)
        return self.get(name, version)

    def add_folder(self, folder: Path, name: str, version: str) -> StoredVersion:
        """Install an artifact folder as NAME@VERSION: verify it, store its files once, link the version."""
        check_name(name, "model name")
        check_name(version, "version")
        open_artifact(folder, verify=True)
        files = release_files(folder)
        with self.locked():
            if self.version_dir(name, version).exists():
                raise StoreError(f"{name}@{version} is already installed; versions never change (pick a new version)")
            for member, entry in files.items():
                self.put_blob(folder / member, entry)
            return self.commit(self.stage(files), name, version)

    def write_refs(self, name: str, refs: Refs) -> None:
        path = self.models / name / "refs.json"
        tmp = path.with_name(f".refs.{secrets.token_hex(4)}.tmp")
        body = {"current": refs.current, "previous": refs.previous, "channel": refs.channel, "key": refs.key,
                "releases": {v: {"published": r.published, "sequence": r.sequence} for v, r in refs.releases.items()}}
        tmp.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def activate(self, name: str, version: str) -> Refs:
        """Make VERSION current; the old current becomes previous."""
        self.get(name, version)
        with self.locked():
            return self.switch(name, version)

    def switch(self, name: str, version: str, *, channel: str | None = None, key: str | None = None,
               stamp: ReleaseStamp | None = None) -> Refs:
        """``activate`` for a caller that already holds ``locked()``: VERSION current, the channel it came from,
        the key to pin if none is pinned yet, and the release's place in its publisher's order."""
        old = self.refs(name)
        releases = {**old.releases, version: stamp} if stamp else old.releases
        previous = old.previous if old.current == version else old.current or old.previous
        new = Refs(version, previous, channel or old.channel, old.key or key, releases)
        self.write_refs(name, new)
        return new

    def pin(self, name: str, key: str) -> Refs:
        """Pin NAME to ``key``: the only key whose channels may update it from now on."""
        if name not in self.names():
            raise ModelNotFoundError(f"no model {name!r} in the store; `edgellm store list` shows them")
        with self.locked():
            new = replace(self.refs(name), key=key)
            self.write_refs(name, new)
        return new

    def rollback(self, name: str) -> Refs:
        """Swap current and previous; nothing is fetched or rewritten but refs.json."""
        refs = self.refs(name)
        if name not in self.names():
            raise ModelNotFoundError(f"no model {name!r} in the store; `edgellm store list` shows them")
        if refs.previous is None:
            raise StoreError(f"{name} has no previous version to roll back to")
        self.get(name, refs.previous)
        with self.locked():
            refs = self.refs(name)  # again under the lock: an update may have switched since
            if refs.previous is None:
                raise StoreError(f"{name} has no previous version to roll back to")
            new = replace(refs, current=refs.previous, previous=refs.current)
            self.write_refs(name, new)
        return new

    def gc(self, *, prune: bool = False) -> tuple[list[str], int, int]:
        """Drop blobs no version links and temp files (partial downloads too); with ``prune``, also every
        version that is neither current nor previous. Returns (pruned NAME@VERSIONs, blobs removed, bytes freed)."""
        pruned: list[str] = []
        busy = "an update or repair is downloading into the store; run gc again when it has finished"
        with _flock(self.root, ".fetch-lock", exclusive=True, busy=busy), self.locked():
            if prune:
                for name in self.names():
                    refs = self.refs(name)
                    for version in self.versions(name):
                        if version not in (refs.current, refs.previous):
                            shutil.rmtree(self.version_dir(name, version))
                            pruned.append(f"{name}@{version}")
            used = {e.sha256 for n in self.names() for v in self.versions(n) for e in self.get(n, v).files.values()}
            removed = freed = 0
            for blob in self.blobs.iterdir() if self.blobs.is_dir() else ():
                if blob.name not in used:
                    freed += blob.stat().st_size
                    blob.unlink()
                    removed += 1
            for stale in self.tmp.iterdir() if self.tmp.is_dir() else ():  # staging and partial downloads
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink()
        return pruned, removed, freed

    def usage(self) -> dict[str, Any]:
        """Bytes in blobs vs. bytes the versions would take as separate copies."""
        blobs = list(self.blobs.iterdir()) if self.blobs.is_dir() else []
        logical = sum(self.get(n, v).total_bytes for n in self.names() for v in self.versions(n))
        return {"blobs": len(blobs), "blob_bytes": sum(b.stat().st_size for b in blobs), "logical_bytes": logical}


@contextlib.contextmanager
def _flock(root: Path, name: str, *, exclusive: bool, busy: str | None = None) -> Iterator[None]:
    """A POSIX advisory lock on ``root/name`` (elsewhere a no-op); waits for it, or with ``busy`` given raises
    StoreError(busy) at once when it is held."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if busy is None else fcntl.LOCK_NB)
    with open(root / name, "a+b") as fh:
        try:
            fcntl.flock(fh.fileno(), mode)
        except BlockingIOError:
            raise StoreError(str(busy)) from None
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _safe_member(name: str) -> str:
    if "/" in name or "\\" in name or name in ("", ".", "..") or name.startswith("."):
        raise ArtifactError(f"a release names an unsafe file {name!r}")
    return name


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (the bytes are stored once); a copy where the file system has none."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
