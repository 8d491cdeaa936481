"""manifest.json: the sha256 and size of every artifact file, checked before anything is loaded."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable

from edgellm.artifact.config import FORMAT_VERSION, MANIFEST_FILE, read_json
from edgellm.errors import ArtifactError

_CHUNK = 1 << 22


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """What the artifact contains and how big it is."""

    files: dict[str, FileEntry]
    parameter_count: int
    bits_per_parameter: float
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    @classmethod
    def build(cls, folder: Path, names: Iterable[str], parameter_count: int, weight_bytes: int) -> Manifest:
        files = {name: FileEntry(sha256_file(folder / name), (folder / name).stat().st_size) for name in names}
        bits = 8.0 * weight_bytes / parameter_count if parameter_count else 0.0
        return cls(files=files, parameter_count=parameter_count, bits_per_parameter=round(bits, 4))

    def write(self, folder: Path) -> None:
        body = {
            "format_version": self.format_version,
            "parameter_count": self.parameter_count,
            "bits_per_parameter": self.bits_per_parameter,
            "total_bytes": self.total_bytes,
            "files": {name: {"sha256": e.sha256, "size": e.size} for name, e in sorted(self.files.items())},
        }
        (folder / MANIFEST_FILE).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST_FILE
        raw = read_json(path, f"{folder} has no {MANIFEST_FILE}: not an edgellm artifact, or a partial one")
        if raw.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"{path} has format_version {raw.get('format_version')!r}; this edgellm reads {FORMAT_VERSION}"
            )
        try:
            files = {name: FileEntry(str(e["sha256"]), int(e["size"])) for name, e in raw["files"].items()}
            manifest = cls(files, int(raw["parameter_count"]), float(raw["bits_per_parameter"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ArtifactError(f"{path} is malformed: {exc}") from None
        for name in files:
            _check_member_name(name)
        return manifest

    def verify(self, folder: Path, *, full: bool = True) -> None:
        """Raise ArtifactError naming the first missing, truncated or modified file."""
        for name, entry in sorted(self.files.items()):
            path = folder / name
            if not path.is_file():
                raise ArtifactError(f"artifact file {name} is missing from {folder}")
            size = path.stat().st_size
            if size != entry.size:
                raise ArtifactError(
                    f"artifact file {name} is {size} bytes, the manifest says {entry.size}: truncated or replaced"
                )
            if full and sha256_file(path) != entry.sha256:
                raise ArtifactError(f"artifact file {name} fails its sha256 check: the file was modified or corrupted")


def _check_member_name(name: str) -> None:
    """Manifest paths must stay inside the artifact folder."""
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name or not pure.parts or name.startswith("~"):
        raise ArtifactError(f"{MANIFEST_FILE} names an unsafe path {name!r}")
