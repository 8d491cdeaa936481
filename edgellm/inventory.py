"""What is on disk: compiled catalog artifacts, stored versions, pulled sources and the downloads cache, with sizes.

`edgellm list`, `edgellm rm` and the server's model listings (/api/tags, /v1/models) read this one module. Each
entry's `name` is what `run`, `serve` and `rm` accept: `NAME` or `NAME:SCHEME` for a compiled catalog model,
`NAME@VERSION` for a stored version, and the artifact folder's path for anything else compiled into the cache.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from edgellm.errors import EdgeLLMError, ModelNotFoundError
from edgellm.paths import artifacts_dir, downloads_dir, sources_dir

Kind = Literal["artifact", "stored", "source", "download"]
KIND_HELP = {"artifact": "compiled, runnable", "stored": "a store version, runnable",
             "source": "pulled source file (recompiles without a download)", "download": "downloaded wheels"}


@dataclass(frozen=True)
class LocalModel:
    """One thing on disk that a name refers to."""

    name: str
    kind: Kind
    path: Path
    size_bytes: int
    modified: float  # unix time
    scheme: str = ""  # quantization scheme, for artifacts and stored versions
    architecture: str = ""
    current: bool = False  # a stored version that NAME alone selects

    @property
    def runnable(self) -> bool:
        return self.kind in ("artifact", "stored")


def folder_size(path: Path) -> int:
    """Bytes of the files under `path` (a hard-linked store blob counts once per link: what deleting frees at most)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def artifact_name(folder: Path) -> str:
    """The name a compiled artifact folder in the cache answers to: `NAME` at the catalog's default scheme,
    `NAME:SCHEME` at another, else the folder's path."""
    from edgellm.artifact.config import ArtifactConfig
    from edgellm.catalog import CATALOG

    try:
        config = ArtifactConfig.read(folder)
    except Exception:  # noqa: BLE001 - an unreadable artifact is listed by its path
        return str(folder)
    name, scheme = config.source.name, config.quantization.scheme
    entry = CATALOG.get(name)
    if entry is None or folder.name != f"{name}-{scheme}" or folder.parent != artifacts_dir():
        return str(folder)
    return name if scheme == entry.default_scheme else f"{name}:{scheme}"


def _artifact(folder: Path, name: str, kind: Kind, current: bool = False) -> LocalModel:
    from edgellm.artifact.config import ArtifactConfig

    try:
        config = ArtifactConfig.read(folder)
        scheme, arch = config.quantization.scheme, config.model.architecture
    except Exception:  # noqa: BLE001 - listed, with what is known
        scheme, arch = "", ""
    return LocalModel(name, kind, folder, folder_size(folder), _mtime(folder), scheme, arch, current)


def local_models(*, runnable_only: bool = False) -> list[LocalModel]:
    """Everything on disk, compiled artifacts first; with `runnable_only`, artifacts and stored versions only."""
    from edgellm.artifact.config import MANIFEST_FILE
    from edgellm.store.local import Store

    out: list[LocalModel] = []
    root = artifacts_dir()
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if folder.is_dir() and (folder / MANIFEST_FILE).is_file():
            out.append(_artifact(folder, artifact_name(folder), "artifact"))
    store = Store()
    for name in store.names():
        current = store.refs(name).current
        for version in store.versions(name):
            out.append(_artifact(store.version_dir(name, version), f"{name}@{version}", "stored", version == current))
    if runnable_only:
        return out
    for kind, base in (("source", sources_dir()), ("download", downloads_dir())):
        for folder in sorted(base.iterdir()) if base.is_dir() else ():
            if folder.is_dir() and not folder.name.startswith("."):
                out.append(LocalModel(folder.name, kind, folder, folder_size(folder), _mtime(folder)))  # type: ignore[arg-type]
    return out


def find_local(name: str) -> Path | None:
    """The artifact folder `name` selects if it is already on disk (nothing is pulled or compiled), else None."""
    from edgellm.catalog import CATALOG
    from edgellm.resolve import _is_current, split_model_name
    from edgellm.store.local import Store

    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        stored = Store().find(name)
    except EdgeLLMError:
        stored = None
    if stored is not None:
        return stored
    base, scheme = split_model_name(name)
    entry = CATALOG.get(base)
    if entry is None:
        return None
    folder = artifacts_dir() / f"{entry.name}-{scheme or entry.default_scheme}"
    return folder if _is_current(folder) else None


def remove(name: str, *, sources: bool = False) -> list[LocalModel]:
    """Delete what `name` (as `edgellm list` shows it) refers to; with `sources`, a catalog model's pulled source
    and downloads too. Refuses a folder a running server holds (edgellm/leases.py) and a store version that is
    current. Returns what was removed; ModelNotFoundError when `name` matches nothing."""
    from edgellm import leases
    from edgellm.resolve import split_model_name

    everything = local_models()
    matches = [m for m in everything if m.name == name and m.runnable]
    base = split_model_name(name)[0]
    kept = [m for m in everything if not m.runnable and m.name == base]
    if sources:
        matches += kept
    if not matches:
        hint = " (only its pulled source and downloads: add --sources)" if kept else ""
        raise ModelNotFoundError(f"nothing called {name!r} on disk{hint}; `edgellm list` shows what there is")
    for model in matches:
        if model.kind == "stored" and model.current:
            raise EdgeLLMError(f"{name} is the current version of {name.split('@')[0]}; activate another version "
                               "first (`edgellm store activate`), or `edgellm store gc --prune`")
        held = leases.holder(model.path)
        if held is not None:
            raise EdgeLLMError(f"{model.name} is loaded by a running server (pid {held.pid}); stop it, or unload "
                               "the model (an Ollama request with keep_alive 0), then retry")
    for model in matches:
        if model.path.is_dir():
            shutil.rmtree(model.path)
        else:
            model.path.unlink(missing_ok=True)
    return matches
