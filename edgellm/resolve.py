"""MODEL arguments: an artifact folder, a stored model (`NAME`, `NAME@VERSION`), or a catalog name
(`smollm2-135m`, `smollm2-135m:q8f16_1`)."""

from __future__ import annotations

from pathlib import Path

from edgellm.errors import ModelNotFoundError

def split_model_name(model: str) -> tuple[str, str | None]:
    """`name:scheme` → (name, scheme); a plain name → (name, None)."""
    name, sep, scheme = model.partition(":")
    return (name, scheme or None) if sep else (model, None)


def _is_current(folder: Path) -> bool:
    """Whether ``folder`` holds an artifact manifest of the format this edgellm reads."""
    import json

    from edgellm.artifact.config import FORMAT_VERSION, MANIFEST_FILE

    try:
        return json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8")).get("format_version") == FORMAT_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def resolve_model(model: str | Path, *, quantization: str | None = None, progress: bool = True) -> Path:
    """Return an artifact folder; a catalog name is pulled and compiled on first use, then cached."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from edgellm.store.local import Store

    stored = Store().find(str(model))  # NAME (its current version) or NAME@VERSION from the versioned store
    if stored is not None:
        return stored
    from edgellm.catalog import CATALOG, get_entry
    from edgellm.paths import artifacts_dir

    if path.suffix == ".gguf" and path.is_file():
        return _compiled_gguf(path, quantization, progress)
    name, scheme = split_model_name(str(model))
    if name not in CATALOG:
        looks_like_path = "/" in str(model) or path.suffix
        what = "no artifact folder" if looks_like_path else "no such model"
        raise ModelNotFoundError(f"{what} {model!r}; catalog models: {', '.join(sorted(CATALOG))}")
    entry = get_entry(name)
    scheme = quantization or scheme or entry.default_scheme
    target = artifacts_dir() / f"{entry.name}-{scheme}"
    if not _is_current(target):  # never compiled, or compiled by an older edgellm: (re)compile
        from edgellm.convert.pipeline import convert

        convert(entry.name, target, quantization=scheme, progress=progress, force=target.exists())
    return target


def _compiled_gguf(path: Path, quantization: str | None, progress: bool) -> Path:
    """A GGUF file's artifact, compiled on first use into the cache under the file's sha256 (so a changed file
    compiles again and a renamed one does not); a catalog model's file gets the catalog's scheme, any other file
    the one `convert x.gguf` gives it: its own blocks, held exactly (`source`)."""
    from edgellm.artifact.manifest import sha256_file
    from edgellm.catalog import CATALOG
    from edgellm.paths import artifacts_dir
    from edgellm.progress import stderr_is_terminal
    from edgellm.quant.schemes import SOURCE_SCHEME

    digest = sha256_file(path)
    entry = next((e for e in CATALOG.values() if e.sha256 == digest), None)
    scheme = quantization or (entry.default_scheme if entry is not None else SOURCE_SCHEME)
    target = artifacts_dir() / f"{path.stem}-{digest[:12]}-{scheme}"
    if not _is_current(target):
        from edgellm.convert.pipeline import convert

        if progress and stderr_is_terminal():
            import sys

            print(f"compiling {path.name} to {scheme} on first use (cached as {target})", file=sys.stderr,
                  flush=True)
        convert(path, target, quantization=scheme, progress=progress, force=target.exists())
    return target
