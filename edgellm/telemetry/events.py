"""What one generation event holds: metadata only, built from the engine and the stream's final stats."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edgellm import __version__

if TYPE_CHECKING:
    from edgellm.artifact.config import ArtifactConfig
    from edgellm.generation import GenerationStats


class _Folder(Protocol):
    @property
    def folder(self) -> Path: ...


class ObservedEngine(Protocol):
    """What an event reads of the engine (runtime/engine.py's Engine): its artifact, config and threads."""

    @property
    def artifact(self) -> _Folder: ...

    @property
    def config(self) -> ArtifactConfig: ...

    @property
    def threads(self) -> int: ...

# Every field an event may carry; the sink's table has exactly these columns (level "basic" fills the first block).
BASIC_FIELDS = ("ts", "model", "version", "scheme", "kernel", "edgellm_version", "device_class", "finish_reason",
                "error_class")
FULL_FIELDS = ("threads", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms", "prefill_tok_s",
               "decode_tok_s", "total_ms", "peak_rss_mib")
FIELDS = BASIC_FIELDS + FULL_FIELDS


@functools.lru_cache(maxsize=1)
def device_class() -> str:
    """CPU family, core count and memory tier, e.g. ``x86_64 AMD EPYC 7B13 / 2 cores / 32 GiB``."""
    return f"{platform.machine() or '?'} {_cpu_family()} / {os.cpu_count() or 1} cores / {_memory_tier()}"


def _cpu_family() -> str:
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.split(":")[0].strip() in ("model name", "Model", "Hardware"):
                name = line.split(":", 1)[1]
                break
    except OSError:
        name = platform.processor()
    if not name and sys.platform == "darwin":
        name = "Apple" if platform.machine() == "arm64" else "Intel"
    name = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|@.*$|\d+-Core Processor|Processor", " ", name)
    return " ".join(name.split())[:48] or "unknown CPU"


def _memory_tier() -> str:
    """Total RAM rounded up to a power of two GiB (a tier, not the exact figure)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return "? GiB"
    tier = 1
    while tier * 2**30 < total * 0.95:
        tier *= 2
    return f"{tier} GiB"


@functools.lru_cache(maxsize=16)
def model_identity(folder: str) -> tuple[str, str]:
    """(name, version) without user paths: a stored NAME@VERSION, a catalog build's name, or ``local``;
    unversioned artifacts are named by the first 12 hex digits of their manifest's sha256."""
    from edgellm.paths import artifacts_dir
    from edgellm.store.local import Store

    path = Path(folder).resolve()
    parts = path.parts
    models = Store().models.resolve().parts
    if parts[: len(models)] == models and len(parts) == len(models) + 3:
        return parts[-3], parts[-1]
    try:
        digest = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()[:12]
    except OSError:
        digest = "unknown"
    if path.parent == artifacts_dir().resolve():
        return path.name, digest
    return "local", digest


def kernel_name(engine: ObservedEngine) -> str:
    """The matmul kernel the engine's main weight format dispatches to (a native one when installed)."""
    from edgellm.quant.dispatch import select_kernel

    formats = engine.config.quantization.formats
    fmt = max(set(formats.values()), key=list(formats.values()).count) if formats else "f32"
    try:
        return select_kernel(fmt).name
    except Exception:  # noqa: BLE001 - telemetry never fails a generation
        return "unknown"


def peak_rss_mib() -> float | None:
    """The process's peak resident memory (None where the platform has no getrusage)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def build_event(engine: ObservedEngine, stats: GenerationStats | None, finish_reason: str, error_class: str | None, level: str) -> dict[str, Any]:
    """One event; ``engine`` is an Engine, ``stats`` its GenerationStats (None after an error)."""
    model, version = model_identity(str(engine.artifact.folder))
    event: dict[str, Any] = {
        "ts": round(time.time(), 3), "model": model, "version": version,
        "scheme": engine.config.quantization.scheme, "kernel": kernel_name(engine),
        "edgellm_version": __version__, "device_class": device_class(),
        "finish_reason": finish_reason, "error_class": error_class,
    }
    if level == "full":
        event["threads"] = engine.threads
        event["peak_rss_mib"] = peak_rss_mib()
        if stats is not None:
            event |= {"prompt_tokens": stats.prompt_tokens, "cached_tokens": stats.cached_tokens,
                      "completion_tokens": stats.completion_tokens, "ttft_ms": round(stats.ttft_s * 1000, 2),
                      "prefill_tok_s": round(stats.prefill_tokens_per_s, 2),
                      "decode_tok_s": round(stats.decode_tokens_per_s, 2), "total_ms": round(stats.total_s * 1000, 2)}
    return event
