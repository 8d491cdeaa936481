"""Open an artifact folder: verify the manifest first, then map the weights."""

from __future__ import annotations

import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgellm.artifact.config import CHAT_TEMPLATE_FILE, MANIFEST_FILE, TOKENIZER_FILE, ArtifactConfig
from edgellm.artifact.manifest import Manifest
from edgellm.artifact.tensors import SHARD_PATTERN, ShardEntry, map_shard, shard_arrays, shard_entries, shard_tensors
from edgellm.errors import ArtifactError
from edgellm.families.tensor_specs import check_tensors

_SHARD_PREFIX = SHARD_PATTERN.split("{")[0]


class Weights(dict[str, Any]):
    """An artifact's tensors by name (torch tensors, or numpy arrays), and the shard mappings they are views of."""

    def __init__(self) -> None:
        super().__init__()
        self.mappings: list[mmap.mmap] = []


@dataclass(frozen=True)
class Artifact:
    """A verified artifact folder."""

    folder: Path
    config: ArtifactConfig
    manifest: Manifest
    weights_check: Future[None] | None = None  # the shards' contents, being checked on a thread

    @property
    def tokenizer_path(self) -> Path:
        return self.folder / TOKENIZER_FILE

    @property
    def chat_template(self) -> str | None:
        """The chat template, where the manifest lists one (a file it does not list is never read)."""
        if CHAT_TEMPLATE_FILE not in self.manifest.files:
            return None
        return (self.folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")

    def unlisted_files(self) -> list[str]:
        """Files in the folder the manifest does not list (never read: reported by `edgellm verify`)."""
        listed = set(self.manifest.files) | {MANIFEST_FILE}
        return sorted(name for p in self.folder.rglob("*") if not p.is_dir()
                      and (name := p.relative_to(self.folder).as_posix()) not in listed)

    @property
    def shard_names(self) -> list[str]:
        return _shard_names(self.manifest)

    def weights(self, *, arrays: bool = False) -> Weights:
        """All tensors: torch tensors (numpy arrays with `arrays`) viewing the memory-mapped shards (copy-on-write),
        mapped anew on each call — once the shards' contents have passed their check, if it is still running
        (else its ArtifactError)."""
        if self.weights_check is not None:
            self.weights_check.result()
        views = shard_arrays if arrays else shard_tensors
        weights = Weights()
        weights.mappings = [map_shard(self.folder / name) for name in self.shard_names]
        entries = _entries(weights.mappings, self.shard_names)
        check_tensors(self.config, {n: e.spec for n, e in entries.items()}, where=f"artifact {self.folder}")
        for mm, name in zip(weights.mappings, self.shard_names, strict=True):
            weights.update(views(mm, name, [e for e in entries.values() if e.shard == name]))
        return weights

    def check_tensors(self) -> None:
        """ArtifactError naming the first tensor whose shard header does not declare exactly what the config says
        the model reads (families/tensor_specs.py): the headers alone are read, no weight bytes."""
        mappings = [map_shard(self.folder / name) for name in self.shard_names]
        try:
            entries = _entries(mappings, self.shard_names)
        finally:
            for mm in mappings:
                mm.close()
        check_tensors(self.config, {n: e.spec for n, e in entries.items()}, where=f"artifact {self.folder}")


def _entries(mappings: list[mmap.mmap], names: list[str]) -> dict[str, ShardEntry]:
    """Every tensor the shards `mappings` (named `names`) declare, by tensor name; ArtifactError for a tensor two
    shards declare."""
    found: dict[str, ShardEntry] = {}
    for mm, name in zip(mappings, names, strict=True):
        for entry in shard_entries(mm, name):
            if entry.name in found:
                raise ArtifactError(f"tensor {entry.name} is in two weight shards, {found[entry.name].shard} and "
                                    f"{name}")
            found[entry.name] = entry
    return found


def _shard_names(manifest: Manifest) -> list[str]:
    """The weight shards a manifest lists, in order."""
    return sorted(n for n in manifest.files if n.startswith(_SHARD_PREFIX))


def open_artifact(folder: str | Path, *, verify: bool = True, sha256: bool = False,
                  check_weights_meanwhile: bool = False) -> Artifact:
    """Check every file against manifest.json, then read the config.

    Sizes always; contents when ``verify``: the fast xxh3 digests, or the sha256 ones with ``sha256``. With
    ``check_weights_meanwhile`` the weight shards' contents are checked on a thread while the caller goes on
    (parsing the tokenizer, which holds the GIL, while hashing releases it); :meth:`Artifact.weights` waits for
    that check and raises what it found, so no weight byte is used unchecked.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ArtifactError(f"artifact folder {path} does not exist")
    manifest = Manifest.read(path)
    later = _shard_names(manifest) if check_weights_meanwhile and verify else []
    manifest.verify(path, full=verify, sha256=sha256, contents_later=frozenset(later))
    for required in (TOKENIZER_FILE, "edgellm-config.json"):
        if required not in manifest.files:
            raise ArtifactError(f"{path}: manifest does not list {required}")
    config = ArtifactConfig.read(path)
    check = None
    if later:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgellm-weights-check")
        check = pool.submit(manifest.check_contents, path, later, sha256=sha256)
        pool.shutdown(wait=False)  # the thread ends with the check
    artifact = Artifact(path, config, manifest, check)
    artifact.check_tensors()
    return artifact
