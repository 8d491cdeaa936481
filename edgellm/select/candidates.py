"""The candidate space expanded into concrete candidates, and the artifacts they need (built when missing).

A model is a catalog name or a local source: a Hugging Face folder (an `edgellm compress` output, a fine-tune)
or a .gguf file. Its quality is measured against a reference model's q0f32: the model's own by default, the model
a folder was compressed from (its `edgellm compress` report says), or the one `[candidates] references` names.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError
from edgellm.select.constraints import Space

RECIPE_PREFIX = "recipe:"
REPORT_SUFFIX = ".report.json"  # what `edgellm compress -o DIR` writes beside DIR


@dataclass(frozen=True)
class Candidate:
    """One model × quantization × backend × settings combination, and the model its KL is measured against."""

    model: str
    scheme: str  # a scheme name, "recipe:PATH", or "gguf" (llama.cpp runs the source GGUF)
    backend: str
    threads: int
    context: int
    reference: str = ""  # "": the model itself

    @property
    def id(self) -> str:
        scheme = Path(self.scheme[len(RECIPE_PREFIX):]).stem if self.scheme.startswith(RECIPE_PREFIX) else self.scheme
        return f"{self.model} {scheme} {self.backend} t{self.threads} ctx{self.context}"

    @property
    def quality_reference(self) -> str:
        return self.reference or self.model

    @property
    def weights(self) -> tuple[str, str, str, str]:
        """What quality and task rates depend on: the same weights give the same rates at any threads."""
        return self.model, self.scheme, self.backend, self.quality_reference

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "reference": self.quality_reference, "id": self.id}


def local_source(model: str) -> Path | None:
    """The Hugging Face folder or .gguf file `model` names on this machine; None for a catalog name."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "manifest.json").is_file():
            raise EdgeLLMError(f"{model} is an edgellm artifact, compiled with one scheme; name the Hugging Face "
                               "folder or .gguf it came from (select compiles each scheme itself)")
        if not (path / "config.json").is_file():
            raise EdgeLLMError(f"{model} has no config.json: not a Hugging Face model folder")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise EdgeLLMError(f"no such model file: {model}")
        return path
    return None


def reference_of(model: str, references: dict[str, str]) -> str:
    """The model whose q0f32 `model`'s quality is measured against (see the module docstring)."""
    if model in references:
        return references[model]
    folder = local_source(model)
    if folder is None or not folder.is_dir():
        return model
    report = folder.with_name(folder.name + REPORT_SUFFIX)
    if not report.is_file():
        return model
    try:
        source = json.loads(report.read_text(encoding="utf-8"))["source"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EdgeLLMError(f"{report}: not a readable edgellm compress report ({exc}); name the reference in "
                           "[candidates] references") from None
    from edgellm.catalog import CATALOG

    if not isinstance(source, str) or not (source in CATALOG or local_source(source) is not None):
        raise EdgeLLMError(f"{report} says {model} was compressed from {source!r}: neither a catalog model nor a path "
                           "here; name the reference in [candidates] references")
    return source


def expand(space: Space, *, llama_cpp_available: bool) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """Every candidate of the space, and those that cannot run here with the reason (rows, not crashes)."""
    out: list[Candidate] = []
    skipped: list[tuple[Candidate, str]] = []
    references = dict(space.references)
    for model in space.models:
        reference = reference_of(model, references)
        is_local = local_source(model) is not None
        for backend in space.backends:
            schemes = ["gguf"] if backend == "llama.cpp" else list(space.schemes)
            for scheme in schemes:
                for threads in space.threads:
                    for context in space.contexts:
                        cand = Candidate(model, scheme, backend, threads, context,
                                         "" if reference == model else reference)
                        if backend == "llama.cpp" and not llama_cpp_available:
                            skipped.append((cand, "llama-cpp-python is not installed (pip install -e '.[compare]')"))
                        elif backend == "llama.cpp" and is_local:
                            skipped.append((cand, "llama.cpp candidates are catalog models (their GGUF)"))
                        else:
                            out.append(cand)
    return out, skipped


@functools.lru_cache(maxsize=64)
def _content_digest(path: Path, stamp: tuple[tuple[str, int, int], ...]) -> str:
    """sha256 over a source's files (names and bytes); `stamp` (name, size, mtime) keys the memo."""
    digest = hashlib.sha256()
    for name, _, _ in stamp:
        digest.update(name.encode() + b"\0")
        with open(path / name if path.is_dir() else path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def source_digest(source: Path) -> str:
    """The content hash of a local source (a changed weight file compiles anew)."""
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    stamp = tuple((str(p.relative_to(source)) if source.is_dir() else p.name, p.stat().st_size, p.stat().st_mtime_ns)
                  for p in files)
    return _content_digest(source.resolve(), stamp)


def artifact_for(model: str, scheme: str, *, progress: bool = False) -> Path:
    """The artifact folder of an edgellm candidate, compiled on first use (recipes and local sources under the
    select cache)."""
    from edgellm.resolve import resolve_model

    local = local_source(model)
    if local is None and not scheme.startswith(RECIPE_PREFIX):
        return resolve_model(f"{model}:{scheme}" if ":" not in model else model, progress=progress)
    from edgellm.catalog import CATALOG
    from edgellm.convert.pipeline import convert
    from edgellm.eval.recipe import load_recipe
    from edgellm.paths import edgellm_home

    if local is None and model not in CATALOG:
        raise EdgeLLMError(f"a recipe candidate needs a catalog model or a local source, not {model!r}")
    if scheme.startswith(RECIPE_PREFIX):
        recipe = Path(scheme[len(RECIPE_PREFIX):]).expanduser()
        base, overrides = load_recipe(recipe)
        label, digest = recipe.stem, hashlib.sha256(recipe.read_bytes()).hexdigest()
    else:
        base, overrides, label, digest = scheme, None, scheme, ""
    name = model
    if local is not None:
        name, digest = local.stem, hashlib.sha256((digest + source_digest(local)).encode()).hexdigest()
    target = edgellm_home() / "select" / "artifacts" / f"{name}-{label}-{digest[:12]}"
    if not (target / "manifest.json").is_file():
        convert(local or model, target, quantization=base, overrides=overrides, progress=progress,
                force=target.exists())
    return target


def weights_fingerprint(cand: Candidate) -> str:
    """A hash of the exact bytes a candidate runs: the artifact's manifest, or the GGUF's recorded sha256."""
    if cand.backend == "llama.cpp":
        from edgellm.bench.backends import gguf_path

        gguf = gguf_path(cand.model)
        sidecar = gguf.with_name(gguf.name + ".sha256")
        if sidecar.is_file():
            return "gguf:" + sidecar.read_text().split()[0]
        stat = gguf.stat()
        return f"gguf:{gguf.name}:{stat.st_size}:{stat.st_mtime_ns}"
    return artifact_fingerprint(artifact_for(cand.model, cand.scheme))


def reference_fingerprint(cand: Candidate) -> str:
    """The hash of the q0f32 artifact a candidate's quality is measured against."""
    return artifact_fingerprint(artifact_for(cand.quality_reference, "q0f32"))


def artifact_fingerprint(folder: Path) -> str:
    return "artifact:" + hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
