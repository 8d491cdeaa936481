"""Which JSON Schema keywords constrained decoding enforces, checked before compiling, with JSON pointers.

The lists below come from probing the installed xgrammar (0.2.9): for each keyword a grammar was compiled and a
string that violates the keyword was fed to a matcher (tests/structured/test_structured_errors.py re-checks every
keyword of the spec, from jsonschema's own list: enforced on a breaking instance, or refused by name). Keywords
that the grammar lets through are refused unless the caller opts into best-effort mode.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from edgellm.errors import SchemaError, pointer_token
from edgellm.structured.pattern_quirks import optional_groups_as_counts
from edgellm.structured.schema_narrowing import Narrowing
from edgellm.structured.schema_normalize import (ASSERTIONS, MAX_GRAMMAR_STEP, TooComplex, is_folder,
                                                 normalize_report)
from edgellm.structured.schema_refs import resolve_refs
from edgellm.structured.schema_strings import SUPPORTED_FORMATS
from edgellm.structured.schema_unicode import translate_schema

# keyword -> why the grammar cannot enforce it
UNENFORCEABLE: dict[str, str] = {
    "not": "a grammar cannot exclude the values a subschema matches (only negations with a grammar form are "
           "rewritten)",
    "uniqueItems": "a grammar cannot exclude duplicate array items (enforced only as maxItems 1, where minItems "
                   "allows)",
    "contains": "no item can be written to match it (contains is enforced on the first minContains items)",
    "minContains": "not an integral count (contains is enforced on the first minContains items)",
    "maxContains": "not an integral count (or below minContains where only arrays are allowed)",
}
# Formats `jsonschema` asserts when validating (the rest, e.g. Kubernetes' "int32" or "byte", are annotations as
# JSON Schema 2020-12 defines format by default: ignored by validators, so they are not refused either).
ASSERTED_FORMATS = frozenset(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
_SUBSCHEMA = ("additionalProperties", "propertyNames", "items", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_JSON_TYPES = {int: "integer", float: "number", str: "string", list: "array", dict: "object"}
_NUMBER_TYPES = {"integer": {"integer"}, "number": {"integer", "number"}}


def _subschemas(node: dict[str, Any], pointer: str) -> Iterator[tuple[Any, str]]:
    """The direct subschemas of `node` with their JSON pointers (property names are never mistaken for keywords)."""
    for key in _SUBSCHEMA:
        if key in node:
            yield node[key], f"{pointer}/{key}"
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from _entries(node[key], f"{pointer}/{pointer_token(key)}", key in ("$defs", "definitions"))
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield child, f"{pointer}/{key}/{i}"


def _entries(mapping: dict[str, Any], pointer: str, definitions: bool) -> Iterator[tuple[Any, str]]:
    """The schemas of a properties/definitions map; folders of definitions are walked into."""
    for name, child in mapping.items():
        if definitions and is_folder(child):
            yield from _entries(child, f"{pointer}/{pointer_token(name)}", True)
        else:
            yield child, f"{pointer}/{pointer_token(name)}"


class _Finding(Exception):
    def __init__(self, keyword: str, pointer: str, why: str) -> None:
        self.keyword, self.pointer, self.why = keyword, pointer, why


def _types(node: dict[str, Any]) -> set[str] | None:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return set(t)
    if "const" in node:
        value = node["const"]
        if isinstance(value, bool) or value is None:
            return {"boolean" if value is not None else "null"}
        return {_JSON_TYPES.get(type(value), "object")}
    return None


def _oneof_disjoint(branches: list[Any]) -> bool:
    """True when every branch has a type and no value can match two branches (so oneOf == anyOf)."""
    seen: set[str] = set()
    for branch in branches:
        types = _types(branch) if isinstance(branch, dict) else None
        if not types:
            return False
        expanded = set().union(*(_NUMBER_TYPES.get(t, {t}) for t in types))
        if expanded & seen:
            return False
        seen |= expanded
    return True


def _findings(node: Any, pointer: str, out: list[_Finding]) -> None:
    if not isinstance(node, dict):
        return
    here = lambda kw: f"{pointer}/{pointer_token(kw)}"  # noqa: E731
    for keyword, why in UNENFORCEABLE.items():
        if keyword in node:
            out.append(_Finding(keyword, here(keyword), why))
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not (ref == "#" or ref.startswith("#/")):
            out.append(_Finding("$ref", here("$ref"), f"only references within this document are followed, not "
                                f"{ref!r} (other documents are not fetched)"))
        siblings = sorted(set(node) & ASSERTIONS - {"$ref"})
        if siblings:
            out.append(_Finding(siblings[0], here(siblings[0]), "keywords next to $ref are ignored by the grammar"))
    nested_id = node.get("id") if pointer else None  # (draft-04's identifier: $id is resolved, schema_refs)
    if isinstance(nested_id, str) and not nested_id.startswith("#") and '"$ref"' in json.dumps(node):
        out.append(_Finding("id", here("id"), "a nested base URI changes how the $refs below resolve; not followed"))
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        out.append(_Finding("allOf", here("allOf"), "allOf with more than one branch is not merged by the grammar"))
    if isinstance(node.get("oneOf"), list) and sum(b is True or b == {} for b in node["oneOf"]) > 1:
        out.append(_Finding("oneOf", here("oneOf"), "two branches match every value, so no value matches exactly one"))
    elif isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1 and not _oneof_disjoint(node["oneOf"]):
        out.append(_Finding("oneOf", here("oneOf"),
                            "oneOf is enforced as anyOf; give each branch a distinct type, or use anyOf"))
    types = _types(node)
    if "multipleOf" in node:
        m, declared = node["multipleOf"], types or set()
        if "integer" not in declared or "number" in declared or not isinstance(m, int) or isinstance(m, bool):
            out.append(_Finding("multipleOf", here("multipleOf"),
                                "only an integer multipleOf on an integer type is enforced"))
        elif m > MAX_GRAMMAR_STEP or any(k in node for k in ("minimum", "maximum", "exclusiveMinimum",
                                                               "exclusiveMaximum")):
            out.append(_Finding("multipleOf", here("multipleOf"), f"the grammar ignores a step above {MAX_GRAMMAR_STEP}"
                                " or next to a bound (enforced as the enum of the multiples on integers)"))
    fmt = node.get("format")
    if (isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS and fmt in ASSERTED_FORMATS
            and (types is None or "string" in types)):
        out.append(_Finding("format", here("format"), f"format {fmt!r} is not enforced (supported: "
                            + ", ".join(sorted(SUPPORTED_FORMATS)) + ")"))
    shapes = [k for k in ("pattern", "format") if k in node and (k == "pattern" or fmt in SUPPORTED_FORMATS)]
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    if len(shapes) > 1 or (shapes and lengths):
        kw = (lengths or shapes[1:])[0]
        out.append(_Finding(kw, here(kw), f"{kw} together with {shapes[0]} is not enforced by the grammar"))
    for child, child_pointer in _subschemas(node, pointer):
        _findings(child, child_pointer, out)


def _required_declared(node: Any, pointer: str, out: list[_Finding]) -> None:
    """Strict mode allows only declared properties: a required name not declared, or a minProperties above their
    count, is unsatisfiable."""
    if not isinstance(node, dict):
        return
    props = node.get("properties", {})
    extra_ok = node.get("additionalProperties", False) is not False or "patternProperties" in node
    types = _types(node)
    if isinstance(node.get("required"), list) and isinstance(props, dict) and not extra_ok and (
            types is None or "object" in types):
        for i, name in enumerate(node["required"]):
            if name not in props:
                out.append(_Finding("required", f"{pointer}/required/{i}",
                                    f"required property {name!r} is not declared in properties"))
    least = node.get("minProperties")
    if (isinstance(least, (int, float)) and not isinstance(least, bool) and isinstance(props, dict) and not extra_ok
            and (types is None or "object" in types) and least > len(props)):
        out.append(_Finding("minProperties", f"{pointer}/minProperties", f"strict mode admits only the {len(props)} "
                            f"declared name(s) (additionalProperties would allow more)"))


def _walk_required(node: Any, pointer: str, out: list[_Finding]) -> None:
    if isinstance(node, dict):
        _required_declared(node, pointer, out)
        for child, child_pointer in _subschemas(node, pointer):
            _walk_required(child, child_pointer, out)


def check_wellformed(schema: Any) -> None:
    """Raise SchemaError if `schema` is not a valid JSON Schema (against its draft's meta-schema)."""
    if not isinstance(schema, dict):
        raise SchemaError(f"a JSON schema must be an object, got {type(schema).__name__}", pointer="")
    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        pointer = "".join(f"/{pointer_token(str(p))}" for p in e.path)
        keyword = str(e.path[-1]) if e.path else None
        raise SchemaError(f"malformed JSON schema at {pointer or '/'}: {e.message}",
                          keyword=keyword, pointer=pointer) from None


def check_schema(schema: Any, *, best_effort: bool = False, strict: bool = True) -> tuple[str, ...]:
    """Check that every keyword of `schema` is enforced; return what is not (best-effort) or raise SchemaError.

    Returns a tuple of "keyword at /json/pointer" strings (empty when everything is enforced).
    """
    return prepare_schema(schema, best_effort=best_effort, strict=strict)[1]


def prepare_schema(schema: Any, *, best_effort: bool = False,
                   strict: bool = True) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The schema to compile (rewritten so the grammar enforces it exactly, see schema_normalize) and what it does
    not enforce (best-effort mode; otherwise SchemaError naming the first keyword and its JSON pointer)."""
    prepared = prepare(schema, best_effort=best_effort, strict=strict)
    return prepared.schema, prepared.unenforced


@dataclass(frozen=True)
class Prepared:
    """A schema ready to compile; what it does not enforce (best-effort mode), and where it accepts less than the
    schema asked for ("keyword at /pointer: how")."""

    schema: dict[str, Any]
    unenforced: tuple[str, ...]
    narrowed: tuple[Narrowing, ...]


def prepare(schema: Any, *, best_effort: bool = False, strict: bool = True) -> Prepared:
    """prepare_schema() with the narrowings of the rewrite."""
    schema = translate_schema(schema)  # `\p{Cc}` spelled out (Python and xgrammar cannot read it), or refused
    check_wellformed(schema)
    schema, unresolved = resolve_refs(schema)  # references by name as #/... pointers
    try:
        normalized, unmergeable, narrowings = normalize_report(schema, strict)
    except TooComplex as e:
        raise SchemaError(f'schema keyword "$ref" at / cannot be enforced: {e} (merging allOf/anyOf/$ref into one '
                          "grammar)", keyword="$ref", pointer="") from None
    found = [_Finding(u.keyword, u.pointer, u.why) for u in unresolved]
    found += [_Finding(u.keyword, u.pointer, u.why) for u in unmergeable]
    _findings(normalized, "", found)
    if strict:
        _walk_required(normalized, "", found)
    if found and not best_effort:
        first = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise SchemaError(
            f'schema keyword "{first.keyword}" at {first.pointer or "/"} cannot be enforced: {first.why}{more}; '
            "remove it, or ask for best-effort mode to generate without it",
            keyword=first.keyword, pointer=first.pointer)
    unenforced = tuple(dict.fromkeys(f"{f.keyword} at {f.pointer or '/'}" for f in found))
    return Prepared(grammar_schema(normalized, best_effort=bool(unenforced)), unenforced, tuple(narrowings))


# A value no string can spell: an open object's key that must be absent is declared with it, which the grammar then
# never writes — and its additional keys exclude declared names (xgrammar has no schema `false` for a member).
NEVER = {"type": "string", "pattern": "[^\\s\\S]"}
_STRIP = ("contains", "minContains", "maxContains")  # xgrammar rejects some of these combinations outright
_YEAR = "([1-9][0-9]{3}|0[0-9]{2}[1-9]|0[0-9][1-9]0|0[1-9]00)"  # 0001..9999, as Python's date accepts
# xgrammar's own "date"/"date-time" formats check the syntax only (2024-02-31 passes); these check the calendar.
DATE_PATTERN = (f"({_YEAR}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|{_YEAR}-(0[469]|11)-(0[1-9]|[12][0-9]|30)"
                f"|{_YEAR}-02-(0[1-9]|1[0-9]|2[0-8])"
                "|([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)-02-29)")
TIME_PATTERN = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_CONTROL_ESCAPES = {ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", ord("\f"): "\\f", ord("\v"): "\\v"}
_FORMAT_PATTERNS = {"date": f"^{DATE_PATTERN}$", "date-time": f"^{DATE_PATTERN}T{TIME_PATTERN}$"}


def grammar_schema(schema: dict[str, Any], *, best_effort: bool = False) -> dict[str, Any]:
    """The schema handed to xgrammar: calendar-exact patterns for date formats; in best-effort mode, without the
    keywords that make xgrammar fail to compile."""
    out = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            _structural_values(node)
            for key in ("properties", "patternProperties"):  # a member that must be absent: one never written
                if isinstance(node.get(key), dict):
                    node[key] = {name: copy.deepcopy(NEVER) if sub is False else sub for name, sub in node[key].items()}
            if best_effort:
                for key in _STRIP:
                    node.pop(key, None)
            fmt = node.get("format")
            if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
                del node["format"]  # an annotation (see ASSERTED_FORMATS), or refused by check_schema
            elif fmt in _FORMAT_PATTERNS and "pattern" not in node:
                del node["format"]
                node["pattern"] = _FORMAT_PATTERNS[fmt]
            if isinstance(node.get("pattern"), str):  # xgrammar rejects a raw newline in a class: the same, escaped
                node["pattern"] = optional_groups_as_counts(node["pattern"].translate(_CONTROL_ESCAPES))
            if isinstance(node.get("patternProperties"), dict):  # key patterns meet the same xgrammar bug
                node["patternProperties"] = {optional_groups_as_counts(k): v
                                             for k, v in node["patternProperties"].items()}
            for child, _ in _subschemas(node, ""):
                walk(child)

    walk(out)
    return out


def _value_schema(value: Any) -> Any:
    """A schema matching exactly `value`, written member by member so the grammar spells it with its own separators
    (xgrammar writes a `const` object or array without spaces, unlike the rest of the reply)."""
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: _value_schema(v) for k, v in value.items()},
                "required": list(value), "additionalProperties": False}
    if isinstance(value, list):
        return {"type": "array", "prefixItems": [_value_schema(v) for v in value], "minItems": len(value),
                "maxItems": len(value)}
    return {"const": value}


def _structural_values(node: dict[str, Any]) -> None:
    """A `const` / `enum` holding objects or arrays, alone (or with its type), as the schema of each value (exact)."""
    if (set(node) & ASSERTIONS) - {"const", "enum", "type"} or ("const" in node) == ("enum" in node):
        return
    values = [node["const"]] if "const" in node else node["enum"]
    if not isinstance(values, list) or not any(isinstance(v, (dict, list)) for v in values):
        return
    scalars = [v for v in values if not isinstance(v, (dict, list))]
    branches = [_value_schema(v) for v in values if isinstance(v, (dict, list))]
    for key in ("const", "enum", "type"):
        node.pop(key, None)
    if scalars:
        branches.insert(0, {"enum": scalars})
    if len(branches) == 1:
        node.update(branches[0])
    else:
        node["anyOf"] = branches
