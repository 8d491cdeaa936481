"""Memory planner (R4): estimate before loading, compare with a budget, and walk the degradation chain.

The chain, in order of what a user gives up: a shorter context → an 8-bit KV cache → a lower-bit
scheme of the same model → a smaller catalog model. Each step keeps the previous steps' changes
available (the scheme step uses the q8 KV cache, and so on); within a step the longest context that
fits wins. `plan_memory` decides from configs alone; `plan_load` resolves model names, finds the
budget the OS reports when none is given, and returns the folder to load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from edgellm.artifact.config import ArtifactConfig, QuantizationConfig
from edgellm.errors import ArtifactError, EdgeLLMError, MemoryBudgetError
from edgellm.runtime.memory import MemoryEstimate, estimate_memory, stored_weight_bytes

MIB = 2**20
MIN_CONTEXT = 512  # the chain never shortens the context below this
MARGIN_FRACTION = 0.10  # of the available memory, kept free for the OS and other programs
MIN_MARGIN = 128 * MIB
STEPS = ("requested", "context", "kv", "scheme", "model")


@dataclass(frozen=True)
class Option:
    """One way to load: which model and scheme, how much context, which KV cache; what it would cost."""

    step: str  # one of STEPS
    model: str  # a folder or catalog name, as given to Engine.load
    quantization: str
    context_window: int
    kv_cache: str
    estimate: MemoryEstimate

    @property
    def total_bytes(self) -> int:
        return self.estimate.total_bytes

    def _differences(self, base: Option) -> list[tuple[str, str]]:
        """(in words, as command-line options) for each setting that differs from `base`."""
        out = []
        if self.model != base.model:
            out.append((f"model {self.model}", self.model))
        if self.quantization != base.quantization:
            out.append((f"scheme {self.quantization}", f"-q {self.quantization}"))
        if self.context_window != base.context_window:
            out.append((f"context {self.context_window}", f"--context-window {self.context_window}"))
        if self.kv_cache != base.kv_cache:
            out.append((f"{self.kv_cache} KV", f"--kv-cache {self.kv_cache}"))
        return out

    def changes(self, base: Option) -> str:
        """What differs from `base`, in words: 'context 2048 and q8 KV'."""
        return " and ".join(words for words, _ in self._differences(base)) or "as requested"

    def flags(self, base: Option) -> str:
        """The command-line options that select this option instead of `base`."""
        return " ".join(flag for _, flag in self._differences(base))

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "model": self.model, "quantization": self.quantization,
                "context_window": self.context_window, "kv_cache": self.kv_cache,
                "memory_bytes": self.estimate.as_dict()}


@dataclass(frozen=True)
class Plan:
    """The requested option, the budget, the first option of each chain step that fits, and the one taken."""

    requested: Option
    budget: int | None
    budget_source: str
    fitting: tuple[Option, ...]  # the best option of each step that fits the budget, in chain order
    chosen: Option | None  # None: nothing fits, or it does not fit and degrading was not allowed

    @property
    def degraded(self) -> bool:
        return self.chosen is not None and self.chosen is not self.requested

    def message(self) -> str:
        """One line for the user: what was needed, what was chosen (or why nothing was)."""
        sequences = self.requested.estimate.sequences
        need = f"{self.requested.total_bytes / MIB:.0f} MiB needed" + (
            f" (the KV caches of {sequences} sequences, serve --parallel {sequences})" if sequences > 1 else "")
        if self.budget is None:
            return f"memory: {need} (no budget known)"
        budget = f"{self.budget / MIB:.0f} MiB budget ({self.budget_source})"
        if self.chosen is self.requested:
            return f"memory: {need} <= {budget}"
        if self.chosen is not None:
            return (f"memory: {need} > {budget}; using {self.chosen.changes(self.requested)}: "
                    f"{self.chosen.total_bytes / MIB:.0f} MiB")
        if not self.fitting:
            return f"memory: {need} > {budget}; no step of the degradation chain fits"
        ways = "; ".join(f"{o.changes(self.requested)} ({o.flags(self.requested)}): {o.total_bytes / MIB:.0f} MiB"
                         for o in self.fitting)
        return f"memory: {need} > {budget}; would fit: {ways}; pass --degrade to take the first"

    def chain(self) -> list[str]:
        """The chain's steps, one line each, with the best option of each that fits."""
        best = {o.step: o for o in self.fitting}
        lines = []
        for step in STEPS[1:]:
            option = best.get(step)
            taken = " (taken)" if option is not None and option is self.chosen else ""
            what = (f"{option.changes(self.requested)}: {option.total_bytes / MIB:.0f} MiB{taken}"
                    if option is not None else "nothing fits")
            lines.append(f"  {step:<8} {what}")
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "budget_source": self.budget_source,
                "requested": self.requested.as_dict(),
                "chosen": self.chosen.as_dict() if self.chosen is not None else None,
                "degraded": self.degraded, "message": self.message()}


# ---- the budget ----------------------------------------------------------------------------------------
def available_memory() -> tuple[int, str] | None:
    """Free memory the OS reports: the smaller of MemAvailable and the cgroup's room; None if unknown."""
    found: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 2**60:  # "max" or a huge number: no limit
            found.append((max(0, int(limit) - int(usage)), "cgroup limit"))
        break
    return min(found) if found else None


def default_budget() -> tuple[int | None, str]:
    """The budget when the caller gives none: available memory minus a margin (10%, at least 128 MiB)."""
    available = available_memory()
    if available is None:
        return None, "unknown"
    free, source = available
    margin = max(MIN_MARGIN, int(free * MARGIN_FRACTION))
    return max(0, free - margin), f"{source} {free / MIB:.0f} MiB minus a {margin / MIB:.0f} MiB margin"


# ---- the chain -------------------------------------------------------------------------------------------
def with_scheme(config: ArtifactConfig, scheme: str) -> ArtifactConfig:
    """`config` as if compiled with `scheme` (formats only: enough to estimate memory)."""
    from edgellm.convert.weight_formats import weight_formats

    if scheme == config.quantization.scheme:
        return config
    formats = weight_formats(config.model, scheme)  # the source scheme needs the source: UnsupportedQuantizationError
    return dataclasses.replace(config, quantization=QuantizationConfig(scheme, config.quantization.group_size,
                                                                      formats))


def _contexts(window: int, floor: int) -> list[int]:
    """window, window/2, ... down to `floor` (the floor itself included when the halving skips it)."""
    out = [window]
    while out[-1] // 2 >= floor:
        out.append(out[-1] // 2)
    if out[-1] > floor and window > floor:
        out.append(floor)
    return out


def plan_memory(config: ArtifactConfig, model: str, *, budget: int | None, budget_source: str = "--memory-budget",
                context_window: int | None = None, kv_cache: str | None = None, degrade: bool = False,
                recompile_from: str | None = None, smaller_models: Sequence[tuple[str, ArtifactConfig]] = (),
                min_context: int = MIN_CONTEXT, sequences: int = 1) -> Plan:
    """Decide how to load `model` (whose artifact config is `config`) within `budget` bytes.

    recompile_from: the catalog name other schemes of this model can be compiled from (None: skip that
    step). smaller_models: (catalog name, config) of the models the last step may switch to. The chain
    never shortens the context below `min_context`. `sequences`: KV caches to hold at once (serve --parallel).
    """
    from edgellm.quant.schemes import SCHEMES

    window = context_window or config.context_window
    kv = kv_cache or config.kv_cache
    scheme = config.quantization.scheme

    def option(step: str, name: str, cfg: ArtifactConfig, ctx: int, kind: str) -> Option:
        return Option(step, name, cfg.quantization.scheme, ctx, kind,
                      estimate_memory(cfg, ctx, kv_cache=kind, sequences=sequences))

    requested = option("requested", model, config, window, kv)
    floor = min(min_context, window)
    steps: list[list[Option]] = [[option("context", model, config, c, kv) for c in _contexts(window, floor)[1:]]]
    steps.append([option("kv", model, config, c, "q8") for c in _contexts(window, floor)] if kv != "q8" else [])
    lower: list[Option] = []
    if recompile_from is not None:
        weights = requested.estimate.weights_bytes
        others = [with_scheme(config, s) for s, sch in SCHEMES.items() if s != scheme and not sch.keeps_source]
        others = [cfg for cfg in others if stored_weight_bytes(cfg) < weights]  # (the rest cannot be smaller)
        for cfg in sorted(others, key=lambda c: -estimate_memory(c, window).weights_bytes):
            if estimate_memory(cfg, window).weights_bytes < weights:
                lower += [option("scheme", recompile_from, cfg, c, "q8") for c in _contexts(window, floor)]
    steps.append(lower)
    smaller = []
    for name, cfg in smaller_models:
        ctx = min(window, cfg.context_window)
        smaller += [option("model", name, cfg, c, "q8") for c in _contexts(ctx, min(floor, ctx))]
    steps.append(smaller)
    fits = (lambda o: budget is None or o.total_bytes <= budget)
    fitting = tuple(next(o for o in options if fits(o)) for options in steps if any(fits(o) for o in options))
    if fits(requested):
        chosen: Option | None = requested
    else:
        chosen = fitting[0] if degrade and fitting else None
    return Plan(requested, budget, budget_source, fitting, chosen)


# ---- loading ---------------------------------------------------------------------------------------------
def _catalog_config(name: str) -> ArtifactConfig | None:
    """The config of a catalog model from any compiled artifact of it, else from its pulled source's GGUF
    header (hyper-parameters and tensor types: what estimating its memory needs; the tokenizer fields carry
    the metadata's special ids only); or None."""
    from edgellm.catalog import get_entry
    from edgellm.paths import artifacts_dir, sources_dir
    from edgellm.quant.schemes import get_scheme

    scheme = get_entry(name).default_scheme
    keeps_source = get_scheme(scheme).keeps_source  # formats from an artifact of that scheme, or the GGUF's header
    for folder in sorted(artifacts_dir().glob(f"{name}-{scheme}" if keeps_source else f"{name}-*")):
        if (folder / "manifest.json").is_file():
            try:
                return with_scheme(ArtifactConfig.read(folder), scheme)
            except ArtifactError:  # e.g. compiled by an older edgellm: its config is no guide
                continue
    path = sources_dir() / name / get_entry(name).filename
    if not path.is_file():
        return None
    return _gguf_config(path, name, scheme)


def _gguf_config(path: Path, name: str, scheme: str) -> ArtifactConfig:
    """What compiling the GGUF at `path` with `scheme` would give, as far as memory goes, from its header alone."""
    from edgellm.artifact.config import SamplingDefaults, SourceInfo, TokenizerConfig
    from edgellm.convert.defaults import DEFAULT_CONTEXT_WINDOW, DEFAULT_PREFILL_CHUNK
    from edgellm.convert.gguf_exact import EXACT_FORMATS
    from edgellm.convert.weight_formats import weight_formats
    from edgellm.families.family import GGUFMeta
    from edgellm.families.registry import family_for_gguf
    from edgellm.runtime.gguf_header import read_gguf_header

    header = read_gguf_header(path)
    fields = header.fields
    family = family_for_gguf(fields.get("general.architecture"))
    meta = GGUFMeta(family.gguf_architecture, fields.get, set(header.tensor_types),
                    header.array_lengths.get("tokenizer.ggml.tokens", 0))
    config = family.config_from_gguf(meta)
    sources = family.gguf_sources(config)

    exact = {int(t): formats for t, formats in EXACT_FORMATS.items()}  # by GGML type code, as the header holds them

    def exact_formats(tensor: str) -> tuple[str, ...]:  # as read_gguf's: whole source tensors of an exact block type
        src = sources.get(tensor)
        code = header.tensor_types.get(src.name) if src is not None and src.rows is None else None
        return () if code is None else exact.get(code, ())

    sidecar = path.with_name(path.name + ".sha256")
    tokenizer = TokenizerConfig(fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id"),
                                fields.get("tokenizer.ggml.padding_token_id"),
                                bool(fields.get("tokenizer.ggml.add_bos_token")), ())
    return ArtifactConfig(
        model=config, tokenizer=tokenizer,
        quantization=QuantizationConfig(scheme, 32, weight_formats(config, scheme, exact_formats=exact_formats)),
        context_window=min(config.max_position_embeddings, DEFAULT_CONTEXT_WINDOW),
        prefill_chunk_size=DEFAULT_PREFILL_CHUNK, sampling=SamplingDefaults(),
        source=SourceInfo("gguf", name, sidecar.read_text().split()[0] if sidecar.is_file() else None))


def _smaller_catalog_models(config: ArtifactConfig, weights: int) -> list[tuple[str, ArtifactConfig]]:
    """Catalog models (compiled or pulled already) whose default scheme needs fewer weight bytes, largest first."""
    from edgellm.catalog import CATALOG

    found = []
    for name in CATALOG:
        if name == config.source.name:
            continue
        cfg = _catalog_config(name)
        if cfg is not None and stored_weight_bytes(cfg) < weights \
                and estimate_memory(cfg, cfg.context_window).weights_bytes < weights:
            found.append((name, cfg))
    return sorted(found, key=lambda nc: -estimate_memory(nc[1], nc[1].context_window).weights_bytes)


def plan_load(model: str | Path, *, quantization: str | None = None, context_window: int | None = None,
              kv_cache: str | None = None, memory_budget: int | None = None, degrade: bool = False,
              progress: bool = True, reserved: int = 0, sequences: int = 1,
              draft_bytes: int = 0) -> tuple[Path, Plan]:
    """Resolve `model`, plan its memory and return (artifact folder to load, plan). `reserved` bytes of the
    budget are set aside beside the model (the prompt cache's budget, session/prompt_cache.py), and `draft_bytes`
    (a draft model's weights, buffers and caches, runtime/draft.py); `sequences` KV caches are counted (a server's
    batch slots, serve --parallel).

    Raises MemoryBudgetError, listing the steps that would fit, when the request does not fit and
    `degrade` is off (or nothing fits).
    """
    from edgellm.catalog import CATALOG
    from edgellm.resolve import resolve_model

    folder = resolve_model(model, quantization=quantization, progress=progress)
    config = ArtifactConfig.read(folder)
    budget, source = (memory_budget, "--memory-budget") if memory_budget is not None else default_budget()
    if reserved and budget is not None:
        budget, source = max(0, budget - reserved), f"{source} less the prompt cache's {reserved / MIB:.0f} MiB"
    if draft_bytes and budget is not None:
        budget, source = max(0, budget - draft_bytes), f"{source} less the draft model's {draft_bytes / MIB:.0f} MiB"
    window = context_window or config.context_window
    if not 0 < window <= config.context_window:
        raise EdgeLLMError(f"context window {window} is outside 1..{config.context_window} for this artifact")
    needed = estimate_memory(config, window, kv_cache=kv_cache or config.kv_cache, sequences=sequences).total_bytes
    if budget is None or needed <= budget:
        plan = plan_memory(config, str(model), budget=budget, budget_source=source, context_window=context_window,
                           kv_cache=kv_cache, sequences=sequences)
        return folder, plan
    catalog_name = config.source.name if config.source.name in CATALOG else None
    weights = estimate_memory(config, window).weights_bytes
    plan = plan_memory(config, str(model), budget=budget, budget_source=source, context_window=context_window,
                       kv_cache=kv_cache, degrade=degrade, recompile_from=catalog_name,
                       smaller_models=_smaller_catalog_models(config, weights), sequences=sequences)
    if plan.chosen is None:
        raise MemoryBudgetError(plan.message())
    chosen = plan.chosen
    if chosen.model != str(model) or chosen.quantization != config.quantization.scheme:
        folder = resolve_model(chosen.model, quantization=chosen.quantization, progress=progress)
    return folder, plan
