"""manifest.json: the size, sha256 and xxh3-128 of every artifact file, checked before anything is loaded.

A load checks sizes and the xxh3-128 digests (~10 GB/s: cheap enough for every load; it catches
truncated, corrupted or swapped files); ``edgellm verify`` and ``open_artifact(sha256=True)`` check
the sha256 digests. Manifests without xxh3 digests are checked with sha256.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Collection, Iterable, Literal, cast, get_args

import xxhash

from edgellm.artifact.config import FORMAT_VERSION, MANIFEST_FILE, check_format_version, read_json
from edgellm.errors import ArtifactError

_CHUNK = 1 << 18  # the read buffer of the digests: fits in L2, faulted once per file


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file."""
    return _digests(path, hashlib.sha256())[0]


def xxh3_file(path: Path) -> str:
    """Hex xxh3-128 of a file."""
    return _digests(path, xxhash.xxh3_128())[0]


def _digests(path: Path, *hashes: Any) -> list[str]:
    """Hex digests of a file under each of ``hashes``, in one pass of 256 KiB chunks read into one reused buffer:
    the file is never mapped whole, so checking a large shard (which the load does beside the tokenizer's parse)
    adds 256 KiB to the resident memory, not the shard; the read and the hashes release the GIL. (A 4 MiB
    buffer mapped afresh per file cost Qwen's 25 shards 0.127 s instead of 0.051 in page faults.)"""
    buffer = bytearray(_CHUNK)
    with path.open("rb", buffering=0) as fh, memoryview(buffer) as view:
        while n := fh.readinto(view):
            for h in hashes:
                h.update(view[:n])
    return [h.hexdigest() for h in hashes]


@dataclass(frozen=True)
class FileEntry:
    """A file's identity is its sha256 and size; the xxh3 digest only speeds up the check on load."""

    sha256: str
    size: int
    xxh3: str | None = field(default=None, compare=False)  # xxh3-128, absent in manifests before format 2


TuningKind = Literal["instruct", "base", "unknown"]


@dataclass(frozen=True)
class Tuning:
    """Whether the source model is instruction-tuned, and which metadata said so (convert/tuning.py decides)."""

    kind: TuningKind = "unknown"
    source: str = "not recorded: compiled before edgellm recorded it"

    def as_dict(self) -> dict[str, str]:
        """As manifest.json, `info --json` and /api/show carry it."""
        return {"kind": self.kind, "source": self.source}


@dataclass(frozen=True)
class Manifest:
    """What the artifact contains and how big it is, and whether its source is instruction-tuned."""

    files: dict[str, FileEntry]
    parameter_count: int
    bits_per_parameter: float
    format_version: int = FORMAT_VERSION
    tuning: Tuning = field(default_factory=Tuning)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    @classmethod
    def build(cls, folder: Path, names: Iterable[str], parameter_count: int, weight_bytes: int,
              tuning: Tuning | None = None) -> Manifest:
        files = {}
        for name in names:
            sha, fast = _digests(folder / name, hashlib.sha256(), xxhash.xxh3_128())
            files[name] = FileEntry(sha, (folder / name).stat().st_size, fast)
        bits = 8.0 * weight_bytes / parameter_count if parameter_count else 0.0
        return cls(files=files, parameter_count=parameter_count, bits_per_parameter=round(bits, 4),
                   tuning=tuning or Tuning())

    def write(self, folder: Path) -> None:
        body = {
            "format_version": self.format_version,
            "parameter_count": self.parameter_count,
            "bits_per_parameter": self.bits_per_parameter,
            "total_bytes": self.total_bytes,
            "tuning": self.tuning.as_dict(),
            "files": {name: _entry_json(e) for name, e in sorted(self.files.items())},
        }
        (folder / MANIFEST_FILE).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST_FILE
        raw = read_json(path, f"{folder} has no {MANIFEST_FILE}: not an edgellm artifact, or a partial one")
        check_format_version(raw.get("format_version"), path)
        try:
            files = {
                name: FileEntry(str(e["sha256"]), int(e["size"]), str(e["xxh3_128"]) if "xxh3_128" in e else None)
                for name, e in raw["files"].items()
            }
            manifest = cls(files, int(raw["parameter_count"]), float(raw["bits_per_parameter"]),
                           tuning=_read_tuning(raw.get("tuning"), path))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ArtifactError(f"{path} is malformed: {exc}") from None
        for name in files:
            _check_member_name(name)
        return manifest

    def verify(self, folder: Path, *, full: bool = True, sha256: bool = False,
               contents_later: Collection[str] = ()) -> None:
        """Raise ArtifactError naming the first missing, truncated or modified file.

        Sizes always; with ``full`` also contents — except those of ``contents_later``, which the caller checks
        with :meth:`check_contents` before it uses them.
        """
        for name, entry in sorted(self.files.items()):
            path = folder / name
            if not path.is_file():
                raise ArtifactError(f"artifact file {name} is missing from {folder}")
            size = path.stat().st_size
            if size != entry.size:
                raise ArtifactError(
                    f"artifact file {name} is {size} bytes, the manifest says {entry.size}: truncated or replaced"
                )
        if full:
            self.check_contents(folder, [name for name in sorted(self.files) if name not in contents_later],
                                sha256=sha256)

    def check_contents(self, folder: Path, names: Iterable[str], *, sha256: bool = False) -> None:
        """Raise ArtifactError naming the first of ``names`` whose content is not the manifest's: xxh3-128 where
        the manifest has it, else (or with ``sha256``) the sha256 digests."""
        for name in names:
            entry, path = self.files[name], folder / name
            if entry.xxh3 is not None and not sha256:
                if xxh3_file(path) != entry.xxh3:
                    raise ArtifactError(
                        f"artifact file {name} fails its xxh3 check: the file was modified or corrupted"
                    )
            elif sha256_file(path) != entry.sha256:
                raise ArtifactError(f"artifact file {name} fails its sha256 check: the file was modified or corrupted")


def _read_tuning(raw: object, path: Path) -> Tuning:
    """The manifest's ``tuning`` object; a manifest written before the field existed says "unknown"."""
    if raw is None:
        return Tuning()
    fields = raw if isinstance(raw, dict) else {}
    kind, source = fields.get("kind"), fields.get("source")
    if kind not in get_args(TuningKind) or not isinstance(source, str):
        raise ArtifactError(f"{path} is malformed: tuning must be {{\"kind\": {' | '.join(get_args(TuningKind))}, "
                            f"\"source\": a string}}, got {raw!r}")
    return Tuning(cast(TuningKind, kind), source)


def _entry_json(e: FileEntry) -> dict[str, str | int]:
    out: dict[str, str | int] = {"sha256": e.sha256, "size": e.size}
    if e.xxh3 is not None:
        out["xxh3_128"] = e.xxh3
    return out


def _check_member_name(name: str) -> None:
    """Manifest paths must stay inside the artifact folder."""
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name or not pure.parts or name.startswith("~"):
        raise ArtifactError(f"{MANIFEST_FILE} names an unsafe path {name!r}")
