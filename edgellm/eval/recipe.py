"""Mixed-precision recipes: `{"base": SCHEME, "overrides": {HF weight prefix: FORMAT}}`, read by `convert --recipe`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError
from edgellm.quant.schemes import SCHEMES

FORMATS = ("f32", "f16", "q8", "q4")


def validate_recipe(raw: Any, where: str = "recipe") -> tuple[str, dict[str, str]]:
    """(base scheme, overrides) from a parsed recipe; one-line errors say what is wrong."""
    if not isinstance(raw, dict):
        raise EdgeLLMError(f"{where}: expected a JSON object with 'base' and 'overrides'")
    unknown = set(raw) - {"base", "overrides", "note", "source", "selected"}
    if unknown:
        raise EdgeLLMError(f"{where}: unknown key {sorted(unknown)[0]!r} (allowed: base, overrides, note, source, "
                           "selected)")
    base = raw.get("base")
    if base not in SCHEMES:
        raise EdgeLLMError(f"{where}: 'base' must be one of {', '.join(SCHEMES)}, not {base!r}")
    overrides = raw.get("overrides", {})
    if not isinstance(overrides, dict):
        raise EdgeLLMError(f"{where}: 'overrides' must be an object of weight prefix → format")
    for prefix, fmt in overrides.items():
        if fmt not in FORMATS:
            raise EdgeLLMError(f"{where}: format {fmt!r} for {prefix} is not one of {', '.join(FORMATS)}")
        if prefix.endswith(".weight"):
            raise EdgeLLMError(f"{where}: name the weight prefix without '.weight' ({prefix.removesuffix('.weight')})")
    return base, dict(overrides)


def load_recipe(path: str | Path) -> tuple[str, dict[str, str]]:
    """Read and validate a recipe file."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgeLLMError(f"no such recipe file: {path}") from None
    except json.JSONDecodeError as exc:
        raise EdgeLLMError(f"recipe {path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    return validate_recipe(raw, str(path))


def write_recipe(path: str | Path, base: str, overrides: dict[str, str], **extra: Any) -> Path:
    """Write a recipe (extra keys: note, source, selected) that `load_recipe` accepts."""
    recipe = {"base": base, "overrides": overrides, **extra}
    validate_recipe(recipe)
    out = Path(path)
    out.write_text(json.dumps(recipe, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out
