"""Validation of generated values against a JSON Schema with `jsonschema` (formats checked too)."""

from __future__ import annotations

from typing import Any

import jsonschema
from jsonschema.validators import validator_for


def schema_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    """Every way `value` breaks `schema`, as "at /pointer: message" strings (empty when it validates)."""
    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return [f"at /{'/'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))]
