"""The candidate space expanded into concrete candidates, and the artifacts they need (built when missing)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError
from edgellm.select.constraints import Space

RECIPE_PREFIX = "recipe:"


@dataclass(frozen=True)
class Candidate:
    """One model × quantization × backend × settings combination."""

    model: str
    scheme: str  # a scheme name, "recipe:PATH", or "gguf" (llama.cpp runs the source GGUF)
    backend: str
    threads: int
    context: int

    @property
    def id(self) -> str:
        scheme = Path(self.scheme[len(RECIPE_PREFIX):]).stem if self.scheme.startswith(RECIPE_PREFIX) else self.scheme
        return f"{self.model} {scheme} {self.backend} t{self.threads} ctx{self.context}"

    @property
    def weights(self) -> tuple[str, str, str]:
        """What quality and task rates depend on: the same weights give the same rates at any threads."""
        return self.model, self.scheme, self.backend

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "id": self.id}


def expand(space: Space, *, llama_cpp_available: bool) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """Every candidate of the space, and those that cannot run here with the reason (rows, not crashes)."""
    out: list[Candidate] = []
    skipped: list[tuple[Candidate, str]] = []
    for model in space.models:
        for backend in space.backends:
            schemes = ["gguf"] if backend == "llama.cpp" else list(space.schemes)
            for scheme in schemes:
                for threads in space.threads:
                    for context in space.contexts:
                        cand = Candidate(model, scheme, backend, threads, context)
                        if backend == "llama.cpp" and not llama_cpp_available:
                            skipped.append((cand, "llama-cpp-python is not installed (pip install -e '.[compare]')"))
                        else:
                            out.append(cand)
    return out, skipped


def artifact_for(model: str, scheme: str, *, progress: bool = False) -> Path:
    """The artifact folder of an edgellm candidate, compiled on first use (recipes under the select cache)."""
    from edgellm.resolve import resolve_model

    if not scheme.startswith(RECIPE_PREFIX):
        return resolve_model(f"{model}:{scheme}" if ":" not in model else model, progress=progress)
    from edgellm.catalog import CATALOG
    from edgellm.convert.pipeline import convert
    from edgellm.eval.recipe import load_recipe
    from edgellm.paths import edgellm_home

    recipe = Path(scheme[len(RECIPE_PREFIX):]).expanduser()
    if model not in CATALOG:
        raise EdgeLLMError(f"a recipe candidate needs a catalog model, not {model!r}")
    base, overrides = load_recipe(recipe)
    digest = hashlib.sha256(recipe.read_bytes()).hexdigest()[:12]
    target = edgellm_home() / "select" / "artifacts" / f"{model}-{recipe.stem}-{digest}"
    if not (target / "manifest.json").is_file():
        convert(model, target, quantization=base, overrides=overrides, progress=progress, force=target.exists())
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
    folder = artifact_for(cand.model, cand.scheme)
    return "artifact:" + hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
