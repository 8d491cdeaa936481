"""A schema for (a part of) the instances a subschema does NOT match, so that `not`, `if`/`else` can be enforced.

`complement(s)` returns a schema C with C ⊆ ¬s — exactly ¬s where every keyword of `s` has an expressible
negation, otherwise a smaller set (never a larger one), or None when no useful part is expressible. A schema is a
conjunction of its keywords, so ¬s is the union of the keywords' negations; a negation that cannot be written is
left out of the union, which only narrows:

- `type` T → the other JSON types (an integer-only T keeps out `number`: "a number that is not an integer" has no
  grammar form);
- `required` [k] → an object without k (`properties: {k: false}`);
- `properties` {k: S} → an object with k whose value is in ¬S;
- `enum` / `const` → `{"not": {"enum": [...]}}`, which schema_normalize resolves against a type or enum next to it
  (the other enum values, `false` for `true`, ...) or drops from an `anyOf` where it cannot;
- `not` S → S; `anyOf` → the intersection of the negations (`allOf`); `allOf` → their union;
- `minItems`/`maxItems`/`minLength`/`maxLength`/`minProperties`/`maxProperties`/`minimum`/`maximum`/
  `exclusiveMinimum`/`exclusiveMaximum` → the opposite bound;
- `pattern` P → strings without any of the characters one of which every match of P contains (a part);
- `contains` S → an array whose items are all in ¬S; `items` S → an array whose first item is in ¬S (a part).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from edgellm.structured.schema_narrowing import lose
from edgellm.structured.schema_strings import without_any_of

TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_BOUNDS = {  # keyword -> (the family's type, the opposite keyword, shift of the bound)
    "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1),
    "minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
    "minProperties": ("object", "maxProperties", -1), "maxProperties": ("object", "minProperties", 1),
    "minimum": ("number", "exclusiveMaximum", 0), "maximum": ("number", "exclusiveMinimum", 0),
    "exclusiveMinimum": ("number", "maximum", 0), "exclusiveMaximum": ("number", "minimum", 0),
}
_MAX_DEPTH = 8
# Keywords whose negation is never among the parts (the complement is then a part of the negation).
_NO_NEGATION = ("format", "multipleOf", "uniqueItems", "prefixItems", "additionalProperties", "patternProperties",
                "propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "minContains",
                "maxContains", "unevaluatedProperties", "unevaluatedItems", "if", "additionalItems", "$dynamicRef",
                "$recursiveRef", "pattern")

Lookup = Callable[[str], Any]


def complement(schema: Any, lookup: Lookup, depth: int = 0, max_parts: int | None = None,
               patterns: bool = False) -> dict[str, Any] | None:
    """A schema whose instances all fail `schema` (see the module docstring); None when none is expressible.
    `max_parts` keeps only the smallest parts of the union (a part of the negation, cheaper to merge); `patterns`
    adds the part of a `pattern`'s negation (a pattern itself, which merges only with some other patterns)."""
    if schema is False:
        return {}
    if schema is True or not isinstance(schema, dict) or depth > _MAX_DEPTH:
        if schema is not True:
            lose("not")
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str):
        try:
            target = lookup(ref)
        except Exception:  # noqa: BLE001 - an unresolvable reference: its negation is unknown
            lose("$ref")
            return None
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        if not isinstance(target, dict):
            return None if rest else complement(target, lookup, depth + 1, patterns=patterns)
        schema = {**target, **rest}  # a keyword in both keeps one: a smaller union of negations, never larger
    parts: list[dict[str, Any] | None] = []
    for key in _NO_NEGATION:
        if key in schema:
            lose(key)
    parts += _type_part(schema)
    if "const" in schema:
        parts.append({"not": {"enum": [schema["const"]]}})
    if isinstance(schema.get("enum"), list):
        parts.append({"not": {"enum": list(schema["enum"])}})
    if "not" in schema:
        parts.append(schema["not"] if isinstance(schema["not"], dict) else ({} if schema["not"] is True else None))
    for name in schema.get("required", []) if isinstance(schema.get("required"), list) else []:
        parts.append({"type": "object", "properties": {name: False}})
    props = schema.get("properties")
    for name, sub in (props.items() if isinstance(props, dict) else []):
        neg = complement(sub, lookup, depth + 1, patterns=patterns)
        if neg is not None:
            parts.append({"type": "object", "required": [name], "properties": {name: neg}})
        elif sub is not True and sub != {}:
            lose("properties")
    without = without_any_of(schema["pattern"]) if patterns and isinstance(schema.get("pattern"), str) else None
    if without is not None:
        parts.append({"type": "string", "pattern": without})
    for key, (family, opposite, shift) in _BOUNDS.items():
        value = schema.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or (shift and value + shift < 0):
            continue  # not a bound, or a count of 0 that every instance reaches
        parts.append({"type": family, opposite: value + shift})
    if "contains" in schema:
        neg = complement(schema["contains"], lookup, depth + 1, patterns=patterns)
        if neg is not None:
            parts.append({"type": "array", "items": neg})
        else:
            lose("contains")
    if "items" in schema and schema["items"] is not True and schema["items"] != {}:
        lose("items")  # (the first item's negation below is a part: a later item may be the one outside)
    if isinstance(schema.get("items"), dict) and "prefixItems" not in schema:
        neg = complement(schema["items"], lookup, depth + 1, patterns=patterns)
        if neg is not None:
            parts.append({"type": "array", "minItems": 1, "prefixItems": [neg]})
    if isinstance(schema.get("allOf"), list):
        negs = [complement(b, lookup, depth + 1, patterns=patterns) for b in schema["allOf"]]
        parts += [n for n in negs if n is not None]
        if any(n is None and b is not True and b != {} for n, b in zip(negs, schema["allOf"])):
            lose("allOf")
    for key in ("anyOf", "oneOf"):  # ¬oneOf ⊇ ¬anyOf, so the intersection of the negations is a part of it
        if isinstance(schema.get(key), list):
            negs = [complement(b, lookup, depth + 1, patterns=patterns) for b in schema[key]]
            known = [n for n in negs if n is not None]
            if known and len(known) == len(negs):
                parts.append({"allOf": known} if len(known) > 1 else known[0])
            if key == "oneOf" or any(n is None for n in negs):
                lose(key)
    if "not" in schema and not isinstance(schema["not"], (dict, bool)):
        lose("not")
    kept = [p for p in parts if p is not None]
    if max_parts is not None and len(kept) > max_parts:
        lose("not")  # (only the smallest parts are kept)
        kept = sorted(kept, key=lambda p: len(json.dumps(p)))[:max_parts]
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else {"anyOf": kept}


def _type_part(schema: dict[str, Any]) -> list[dict[str, Any]]:
    t = schema.get("type")
    named = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if named is None:
        return []
    if "number" in named:
        named |= {"integer"}
    if "integer" in named:
        if "number" not in named:
            lose("type")
        named |= {"number"}  # a non-integral number is outside, but has no grammar form of its own
    rest = [x for x in TYPES if x not in named]
    return [{"type": rest if len(rest) > 1 else rest[0]}] if rest else []
