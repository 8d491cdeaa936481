"""The constraints file of `edgellm select` (TOML): the candidate space, the method, the limits, the weights.

```toml
[device]
class = "laptop-2core"            # a label for the results (Ray: the node tag that measures them)

[candidates]
models = ["smollm2-135m", "qwen2.5-coder-0.5b", "./smol-24l"]   # catalog names, Hugging Face folders, .gguf files
references = { "./smol-24l" = "smollm2-135m" }  # KL against another model's q0f32 (a compress output's report
                                                 # names its source; without either: the model's own q0f32)
schemes = ["q4f16_1", "q4f16_1e8", "q8f16_1"]   # scheme names, or recipe files: "recipe:path/to/r.json"
backends = ["edgellm", "llama.cpp"]             # llama.cpp only where llama-cpp-python is installed
threads = [1, 2]
context = [2048]

[method]                          # the bench and eval settings every candidate is measured with
prompt_tokens = 256
gen_tokens = 64
warmup = 2
runs = 5
quality_ctx = 256
quality_windows = 2               # windows per corpus text for KL / PPL ratio / top-1 vs the model's q0f32
task_items = 20                   # items of the `eval task` set (0: no task rates)

[constraints]                     # <metric>_max or <metric>_min; every one must hold
ttft_p90_ms_max = 800
decode_tok_s_min = 20
peak_memory_mib_max = 900
kl_max = 0.05
task_values_correct_min = 50      # percent

[weights]                         # ranking of the candidates that pass (default: decode speed)
decode_tok_s = 1.0
kl = 2.0
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from edgellm.errors import EdgeLLMError
from edgellm.tomlfile import load_toml

Direction = Literal["max", "min"]

# metric -> (better when, unit label). "max" metrics are better when lower (they get a _max limit).
METRICS: dict[str, tuple[Direction, str]] = {
    "ttft_p90_ms": ("max", "TTFT p90 ms"),
    "ttft_ms": ("max", "TTFT ms"),
    "decode_tok_s": ("min", "decode tok/s"),
    "prefill_tok_s": ("min", "prefill tok/s"),
    "peak_memory_mib": ("max", "peak MiB"),
    "load_s": ("max", "load s"),
    "kl": ("max", "KL"),
    "ppl_ratio": ("max", "PPL ratio"),
    "top1": ("min", "top-1 %"),
    "task_valid_json": ("min", "valid %"),
    "task_fields_complete": ("min", "complete %"),
    "task_values_correct": ("min", "correct %"),
}
SPEED_METRICS = ("ttft_p90_ms", "ttft_ms", "decode_tok_s", "prefill_tok_s", "peak_memory_mib", "load_s")
QUALITY_METRICS = ("kl", "ppl_ratio", "top1")
TASK_METRICS = ("task_valid_json", "task_fields_complete", "task_values_correct")
BACKENDS = ("edgellm", "llama.cpp")


class ConstraintsError(EdgeLLMError):
    """A constraints file that cannot be read or has a bad field."""


@dataclass(frozen=True)
class Limit:
    """metric <= bound (kind "max") or metric >= bound (kind "min")."""

    metric: str
    kind: Direction
    bound: float

    @property
    def name(self) -> str:
        return f"{self.metric}_{self.kind}"

    def margin(self, value: float) -> float:
        """How far inside the limit `value` is, as a fraction of the bound (negative: it fails)."""
        room = self.bound - value if self.kind == "max" else value - self.bound
        return room / abs(self.bound) if self.bound else room

    def passes(self, value: float | None) -> bool:
        return value is not None and self.margin(value) >= 0


@dataclass(frozen=True)
class Space:
    models: tuple[str, ...]
    schemes: tuple[str, ...] = ("q4f16_1",)
    backends: tuple[str, ...] = ("edgellm",)
    threads: tuple[int, ...] = (1,)
    contexts: tuple[int, ...] = (2048,)
    references: tuple[tuple[str, str], ...] = ()  # (model, the model its quality is measured against)


@dataclass(frozen=True)
class Method:
    prompt_tokens: int = 256
    gen_tokens: int = 64
    warmup: int = 2
    runs: int = 5
    quality_ctx: int = 256
    quality_windows: int = 2
    task_items: int = 20


@dataclass(frozen=True)
class Constraints:
    space: Space
    method: Method = field(default_factory=Method)
    limits: tuple[Limit, ...] = ()
    weights: dict[str, float] = field(default_factory=lambda: {"decode_tok_s": 1.0})
    device_class: str = "this-device"

    def needs(self, metrics: tuple[str, ...]) -> bool:
        """Whether a limit or a weight looks at any of `metrics` (so that kind of measurement must run)."""
        wanted = {lim.metric for lim in self.limits} | set(self.weights)
        return bool(wanted & set(metrics))


class _Table:
    def __init__(self, where: str, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise ConstraintsError(f"[{where}] must be a table")
        self.where, self.raw = where, raw
        self.used: set[str] = set()

    def get(self, key: str, default: Any, check: Any, what: str) -> Any:
        self.used.add(key)
        if key not in self.raw:
            return default
        value = self.raw[key]
        if isinstance(value, bool) or not check(value):
            raise ConstraintsError(f"[{self.where}] {key} must be {what}, not {value!r}")
        return value

    def done(self) -> None:
        extra = sorted(set(self.raw) - self.used)
        if extra:
            raise ConstraintsError(f"[{self.where}] unknown field {extra[0]!r}")


def _list(kind: type, allowed: tuple[Any, ...] | None = None):
    def check(value: Any) -> bool:
        return (isinstance(value, list) and bool(value) and all(isinstance(v, kind) and not isinstance(v, bool)
                                                                 for v in value)
                and (allowed is None or all(v in allowed for v in value)))
    return check


def _str_table(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) and v.strip() for v in value.values())


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def parse_constraints(raw: dict[str, Any]) -> Constraints:
    """Validated Constraints from parsed TOML; ConstraintsError names the first bad field."""
    extra = sorted(set(raw) - {"device", "candidates", "method", "constraints", "weights"})
    if extra:
        raise ConstraintsError(f"unknown table [{extra[0]}]; expected device, candidates, method, constraints, weights")
    if "candidates" not in raw:
        raise ConstraintsError("[candidates] is required (at least models = [...])")
    c = _Table("candidates", raw["candidates"])
    if "models" not in c.raw:
        raise ConstraintsError("[candidates] models is required")
    space = Space(
        models=tuple(c.get("models", None, _list(str), "a non-empty list of model names")),
        schemes=tuple(c.get("schemes", ["q4f16_1"], _list(str), "a non-empty list of scheme names")),
        backends=tuple(c.get("backends", ["edgellm"], _list(str, BACKENDS), f"a list of {' / '.join(BACKENDS)}")),
        threads=tuple(c.get("threads", [1], _list(int), "a non-empty list of thread counts")),
        contexts=tuple(c.get("context", [2048], _list(int), "a non-empty list of context lengths")),
        references=tuple(c.get("references", {}, _str_table, "a table of model = reference model").items()),
    )
    c.done()
    unknown = [m for m, _ in space.references if m not in space.models]
    if unknown:
        raise ConstraintsError(f"[candidates] references names {unknown[0]!r}, which is not in models")
    if any(t < 1 for t in space.threads) or any(n < 64 for n in space.contexts):
        raise ConstraintsError("[candidates] threads must be >= 1 and context >= 64")
    m = _Table("method", raw.get("method", {}))
    defaults = Method()
    method = Method(**{key: m.get(key, getattr(defaults, key), _positive_int, "a whole number >= 0")
                       for key in Method.__dataclass_fields__})
    m.done()
    if method.runs < 1 or method.gen_tokens < 2 or method.prompt_tokens < 1 or method.quality_ctx < 16:
        raise ConstraintsError("[method] needs runs >= 1, gen_tokens >= 2, prompt_tokens >= 1, quality_ctx >= 16")
    limits = []
    for key, value in _Table("constraints", raw.get("constraints", {})).raw.items():
        metric, _, kind = key.rpartition("_")
        if kind not in ("max", "min") or metric not in METRICS:
            raise ConstraintsError(f"[constraints] {key!r} is not <metric>_max or <metric>_min; metrics: "
                                   + ", ".join(METRICS))
        if kind != METRICS[metric][0]:
            better = "lower" if METRICS[metric][0] == "max" else "higher"
            raise ConstraintsError(f"[constraints] {key}: {metric} is better {better}; use {metric}_{METRICS[metric][0]}")
        if isinstance(value, bool) or not _number(value):
            raise ConstraintsError(f"[constraints] {key} must be a number, not {value!r}")
        limits.append(Limit(metric, kind, float(value)))
    weights_raw = _Table("weights", raw.get("weights", {"decode_tok_s": 1.0})).raw
    weights = {}
    for key, value in weights_raw.items():
        if key not in METRICS:
            raise ConstraintsError(f"[weights] unknown metric {key!r}; metrics: {', '.join(METRICS)}")
        if isinstance(value, bool) or not _number(value) or value < 0:
            raise ConstraintsError(f"[weights] {key} must be a number >= 0, not {value!r}")
        weights[key] = float(value)
    d = _Table("device", raw.get("device", {}))
    device = d.get("class", "this-device", lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
    d.done()
    return Constraints(space, method, tuple(limits), weights, device)


def load_constraints(path: str | Path) -> Constraints:
    """Read and validate a constraints file; every problem is one ConstraintsError line naming the file."""
    return load_toml(path, "constraints file", parse_constraints, ConstraintsError)
