"""Open an artifact folder: verify the manifest first, then map the weights."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgellm.artifact.config import CHAT_TEMPLATE_FILE, TOKENIZER_FILE, ArtifactConfig
from edgellm.artifact.manifest import Manifest
from edgellm.artifact.tensors import SHARD_PATTERN, huge_pages_available, load_shard, read_into_huge_pages, shard_tensors
from edgellm.errors import ArtifactError

_SHARD_PREFIX = SHARD_PATTERN.split("{")[0]


@dataclass(frozen=True)
class Artifact:
    """A verified artifact folder."""

    folder: Path
    config: ArtifactConfig
    manifest: Manifest
    resident: dict[str, mmap.mmap] = field(default_factory=dict)  # shards read into huge pages (and checked)

    @property
    def tokenizer_path(self) -> Path:
        return self.folder / TOKENIZER_FILE

    @property
    def chat_template(self) -> str | None:
        path = self.folder / CHAT_TEMPLATE_FILE
        return path.read_text(encoding="utf-8") if path.is_file() else None

    @property
    def shard_names(self) -> list[str]:
        return _shard_names(self.manifest)

    def weights(self) -> dict[str, torch.Tensor]:
        """All tensors: views of the shards read into huge pages at open, or memory-mapped (copy-on-write)."""
        tensors: dict[str, torch.Tensor] = {}
        for name in self.shard_names:
            held = self.resident.get(name)
            tensors.update(shard_tensors(held, name) if held is not None else load_shard(self.folder / name))
        return tensors


def _shard_names(manifest: Manifest) -> list[str]:
    """The weight shards a manifest lists, in order."""
    return sorted(n for n in manifest.files if n.startswith(_SHARD_PREFIX))


def open_artifact(folder: str | Path, *, verify: bool = True, sha256: bool = False,
                  huge_pages: bool = False) -> Artifact:
    """Check every file against manifest.json, then read the config.

    Sizes always; contents when ``verify``: the fast xxh3 digests, or the sha256 ones with ``sha256``.
    With ``huge_pages`` (where the OS has transparent huge pages) the weight shards are read into anonymous
    memory backed by 2 MiB pages, and it is those bytes that are checked, not the file's again.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ArtifactError(f"artifact folder {path} does not exist")
    manifest = Manifest.read(path)
    shards = _shard_names(manifest) if huge_pages and huge_pages_available() else []
    manifest.verify(path, full=verify, sha256=sha256, contents_checked_by_caller=frozenset(shards))
    resident = {}
    for name in shards:
        resident[name] = read_into_huge_pages(path / name)
        if verify:
            manifest.check_bytes(name, resident[name], sha256=sha256)
    for required in (TOKENIZER_FILE, "edgellm-config.json"):
        if required not in manifest.files:
            raise ArtifactError(f"{path}: manifest does not list {required}")
    return Artifact(path, ArtifactConfig.read(path), manifest, resident)
