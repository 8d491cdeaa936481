"""Validation of generated values against a JSON Schema with `jsonschema` (formats checked too)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
from jsonschema import ValidationError
from jsonschema.validators import extend, validator_for

from edgellm.structured.schema_unicode import translate


def _search(pattern: str, text: str) -> bool:
    """re.search, or for a pattern Python's `re` cannot read (a Unicode property escape such as `\\p{Cc}`, valid
    ECMA-262) the `regex` module's, which reads them (or, without it, re.search of the escapes spelled out)."""
    try:
        return re.search(pattern, text) is not None
    except re.error:
        try:
            import regex  # (in the test extras: an engine independent of the grammar's translation)
        except ImportError:  # the exact translation of the escapes the grammar uses (schema_unicode)
            return re.search(translate(pattern), text) is not None
        return regex.search(pattern, text) is not None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any
                        ) -> Iterator[ValidationError]:
    if validator.is_type(instance, "object"):
        for pattern, sub in patterns.items():
            for key, value in instance.items():
                if _search(pattern, key):
                    yield from validator.descend(value, sub, path=key, schema_path=pattern)


def validator(schema: dict[str, Any], *, formats: bool = True) -> Any:
    """A `jsonschema` validator for `schema` (its draft), formats checked unless `formats` is False, whose patterns
    may use Unicode property escapes."""
    cls = _with_patterns(validator_for(schema, default=jsonschema.Draft202012Validator))
    return cls(schema, format_checker=cls.FORMAT_CHECKER if formats else None)


@functools.cache
def _with_patterns(cls: Any) -> Any:
    """The draft's validator class with the pattern keywords above (made once per draft)."""
    return extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties})


def schema_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    """Every way `value` breaks `schema`, as "at /pointer: message" strings (empty when it validates)."""
    return [f"at /{'/'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in sorted(validator(schema).iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))]
