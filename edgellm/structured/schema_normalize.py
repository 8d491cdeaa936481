"""Rewrite a JSON Schema into one the grammar enforces exactly: every instance of the result is an instance of the
original (the rewrite may only narrow), or the part that cannot be rewritten is reported with its JSON pointer.

xgrammar (0.2.9) silently ignores some shapes that real-world schemas use everywhere. Probed facts:

- a schema without `type` ignores string/number/object keywords other than `properties` / `items`
  (`{"minLength": 3}` accepts `"a"`, typeless `patternProperties` accepts anything): the type is inferred from
  the keywords present (a list of types when they belong to several);
- keywords next to `anyOf` / `oneOf`, and next to a one-branch `allOf`, are ignored: they are merged into each
  branch (`P and (A or B)` is `(P and A) or (P and B)`), and `allOf` branches (local `$ref`s inlined) are merged
  into one schema — keyword by keyword, as an intersection; what has no exact intersection is reported;
- keywords next to `$ref` are merged the same way (for drafts before 2019-09 they are ignored by validators, so
  merging only narrows);
- `unevaluatedProperties` / `unevaluatedItems` are ignored: without applicators in the same schema they mean
  `additionalProperties` / `items`, and are rewritten so;
- draft-04 forms make xgrammar fail with a message that names no keyword: boolean `exclusiveMinimum` /
  `exclusiveMaximum` and array-form `items` (with `additionalItems`) are rewritten to the 2020-12 forms;
- `enum` values of a type the schema excludes are accepted: they are dropped;
- `if`/`then`/`else`, `not`, `dependentRequired`/`dependentSchemas`/`dependencies`, `uniqueItems`, `contains` and
  overlapping `oneOf` branches are ignored: they are rewritten with the negations of schema_complement (exact where
  a negation has a grammar form, otherwise narrowed), string keywords the grammar cannot combine with
  schema_strings; object keys are intersected exactly (`additionalProperties` of one branch against another's
  properties), and a branch / optional member that no instance can match is dropped / forbidden;
- an optional property whose schema refers to another document (not fetched) is forbidden (a narrowing).
"""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from re import _parser as sre_parse  # type: ignore[attr-defined]
from collections.abc import Callable
from typing import Any, TypeGuard

import jsonschema
from jsonschema import Draft202012Validator

from edgellm.errors import pointer_token
from edgellm.structured import schema_narrowing as narrowing
from edgellm.structured.schema_complement import complement
from edgellm.structured.schema_strings import SUPPORTED_FORMATS, intersect_patterns, narrow_strings, whole_string

DEFS = frozenset({"$defs", "definitions"})
FAMILIES: dict[str, frozenset[str]] = {
    "object": frozenset({"properties", "patternProperties", "additionalProperties", "required", "propertyNames",
                         "minProperties", "maxProperties", "unevaluatedProperties", "dependentRequired",
                         "dependentSchemas", "dependencies"}),
    "array": frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
                        "minContains", "maxContains", "unevaluatedItems"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
}
_APPLICATORS = ("anyOf", "oneOf", "allOf")
# Keywords that constrain instances; every other keyword (title, x-*, markdownDescription, ...) is an annotation.
ASSERTIONS = frozenset().union(*FAMILIES.values(), {"type", "enum", "const", "$ref", "not", "if", "then", "else",
                                                   "$dynamicRef", "$recursiveRef", *_APPLICATORS})
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
# Keywords `jsonschema` checks on a value alone (no subschema): an enum/const is filtered by them.
_VALUE_CHECKED = FAMILIES["string"] | FAMILIES["number"]
_OBJECT_SHAPE = ("properties", "additionalProperties", "patternProperties", "unevaluatedProperties", "propertyNames")
_TYPE_OF = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}


class Unmergeable(Exception):
    """A part of the schema that has no exact rewrite (keyword and JSON pointer, as SchemaError reports them)."""

    def __init__(self, keyword: str, pointer: str, why: str) -> None:
        super().__init__(why)
        self.keyword, self.pointer, self.why = keyword, pointer, why


class TooComplex(Exception):
    """Merging would visit more than MAX_VISITS subschemas (or nest too deep): refused as a whole."""


MAX_VISITS = 40000
MAX_PRODUCT = 256  # anyOf branches merged pairwise at most
MAX_NEGATION_PARTS = 4  # a oneOf branch is narrowed by at most this many parts of each other branch's negation
MEMO_MIN_CHARS = 200  # nodes whose JSON text is shorter are cheaper to rewrite again than to look up


class Empty(Unmergeable):
    """The intersection has no instance at all (e.g. different types): an anyOf branch that can be dropped."""


def _copy(value: Any) -> Any:
    """A deep copy of a JSON value (through the C encoder: many times faster than copy.deepcopy)."""
    return json.loads(json.dumps(value))


def _types(value: Any) -> set[str] | None:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return set(value)
    return None


def _value_type_ok(value: Any, types: set[str]) -> bool:
    kind = _TYPE_OF.get(type(value), "object")
    return kind in types or (kind == "integer" and "number" in types) or (
        kind == "number" and "integer" in types and float(value).is_integer())


def _constraints(node: dict[str, Any]) -> set[str]:
    """The keywords of `node` that constrain instances (annotations and definitions excluded)."""
    return set(node) & ASSERTIONS


def _merge(a: dict[str, Any], b: dict[str, Any], pointer: str) -> dict[str, Any]:
    """The schema of the instances valid under both `a` and `b`, keyword by keyword; Unmergeable where inexact,
    Empty where no instance is valid under both."""
    out = _copy(a)
    if any(k in a or k in b for k in _OBJECT_SHAPE):
        _merge_object(a, b, out, pointer)
    tuples = "prefixItems" in a or "prefixItems" in b
    if tuples:
        _merge_tuple(a, b, out, pointer)
    for key, value in b.items():
        if key in _OBJECT_SHAPE or (key not in ASSERTIONS and key not in DEFS) or (
                tuples and key in ("prefixItems", "items")):
            continue
        if key not in out or out[key] == value:
            out[key] = _copy(value)
        elif key in DEFS:
            out[key] = {**value, **out[key]}
        elif key == "type":
            mine, theirs = _types(out[key]) or set(), _types(value) or set()
            both = (mine & theirs) | ({"integer"} if ("integer" in mine and "number" in theirs)
                                      or ("number" in mine and "integer" in theirs) else set())
            if not both:
                raise Empty("type", pointer, f"branches require different types {sorted(mine | theirs)}")
            out[key] = sorted(both) if len(both) > 1 else next(iter(both))
        elif key == "required":
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key in _LOWER and _is_number(value) and _is_number(out[key]):
            out[key] = max(out[key], value)
        elif key in _UPPER and _is_number(value) and _is_number(out[key]):
            out[key] = min(out[key], value)
        elif key == "multipleOf" and _is_number(value) and _is_number(out[key]) and value > 0 and out[key] > 0:
            p, q = _fraction(out[key]), _fraction(value)  # multiples of both: of their least common multiple
            lcm = Fraction(math.lcm(p.numerator, q.numerator), math.gcd(p.denominator, q.denominator))
            out[key] = lcm.numerator if lcm.denominator == 1 else float(lcm)
        elif key == "enum" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = [v for v in out[key] if _json(v) in {_json(w) for w in value}]
        elif key == "const":
            raise Empty("const", pointer, "branches require different constants")
        elif key == "pattern" and _exclusion(out[key]) is not None and _exclusion(value) is not None:
            out[key] = f"^[^{_exclusion(out[key])}{_exclusion(value)}]*$"  # neither set of characters
        elif key == "pattern" and (joint := intersect_patterns(out[key], value)) is not None:
            out[key] = joint  # (a narrowing, see schema_strings)
            narrowing.note("pattern", f"{pointer}/pattern", f"two patterns intersected as {joint!r}")
        elif key == "not" and _excluded(out[key]) is not None and _excluded(value) is not None:
            out[key] = {"enum": [*_excluded(out[key]), *_excluded(value)]}  # type: ignore[misc]
        elif key == "not":  # (not A) and (not B) = not (A or B)
            out[key] = {"anyOf": [*_alternatives(out[key]), *_alternatives(value)]}
        elif key == "$ref":  # both references apply: the second is merged when this node is rewritten
            out["allOf"] = [*out.get("allOf", []), {"$ref": value}]
        elif key == "items":
            out[key] = _merge_or_false(out[key], value, f"{pointer}/items")
        elif key == "allOf" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = [*out[key], *value]
        elif key == "anyOf" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = _distribute(out[key], value, pointer)
        else:
            raise Unmergeable(key, pointer, f"{key} differs between branches and has no exact intersection")
    _settle(out, pointer)
    return out


# What may evaluate members beyond a schema's own properties/items (a `not` evaluates nothing that counts).
_EVALUATORS = (*_APPLICATORS, "$ref", "if", "dependentSchemas", "dependencies", "contains", "$dynamicRef",
               "$recursiveRef")


def _closed(node: dict[str, Any], pointer: str) -> dict[str, Any]:
    """`node` with unevaluatedProperties/unevaluatedItems written as additionalProperties/items where only its own
    keywords evaluate members (exact), so that a merge cannot count another schema's members as evaluated."""
    if ("unevaluatedProperties" not in node and "unevaluatedItems" not in node) or any(
            k in node for k in _EVALUATORS):
        return node
    out = dict(node)
    _close_unevaluated(out, pointer)
    return out


def _close_unevaluated(node: dict[str, Any], pointer: str) -> None:
    """In place: unevaluated* of a node whose members only its own keywords evaluate become additionalProperties /
    items (exact); next to a `not` with other applicators they are refused (the negation would count as evaluating)."""
    if "unevaluatedProperties" not in node and "unevaluatedItems" not in node:
        return
    if any(k in node for k in _EVALUATORS):
        if "not" in node or "if" in node:
            key = "unevaluatedProperties" if "unevaluatedProperties" in node else "unevaluatedItems"
            raise Unmergeable(key, f"{pointer}/{key}", f"{key} next to not/if and other applicators depends on "
                              "what a failing subschema evaluates; not enforced")
        return
    for key, plain in (("unevaluatedProperties", "additionalProperties"), ("unevaluatedItems", "items")):
        if key in node:
            value = node.pop(key)
            node.setdefault(plain, value)


_ALL_TYPES = ("array", "boolean", "null", "number", "object", "string")
_BRANCH = re.compile(r"/(anyOf|oneOf|allOf)/\d+$|/(if|then|else|not)$")


def _merge_sub(a: Any, b: Any, pointer: str) -> Any:
    """_merge for subschemas that may be booleans (`true` and `{}` match everything, `false` nothing)."""
    if _is_true(a):
        return _copy(b)
    if _is_true(b):
        return _copy(a)
    if a is False or b is False:
        return False
    return _merge(_closed(a, pointer), _closed(b, pointer), pointer)


def _can_merge(a: Any, b: Any) -> bool:
    """Can an instance match both `a` and `b` (an inexact merge counts as possible)?"""
    try:
        return _merge_sub(a, b, "") is not False
    except Empty:
        return False
    except Unmergeable:
        return True


def _merge_or_false(a: Any, b: Any, pointer: str) -> Any:
    """_merge_sub where an empty intersection is `false`: a member (property, item) that cannot be present."""
    try:
        return _merge_sub(a, b, pointer)
    except Empty:
        return False


def _distribute(mine: list[Any], theirs: list[Any], pointer: str) -> list[Any]:
    """(A1 or A2) and (B1 or B2) = (A1 and B1) or (A1 and B2) or ...: the pairs that can match at all. A pair with
    no exact intersection is left out (a narrowing) while another pair is kept."""
    out, blocked = [], None
    for i, x in enumerate(mine):
        for y in theirs:
            try:
                both = _merge_sub(x, y, f"{pointer}/anyOf/{i}")
            except Empty:
                continue
            except Unmergeable as e:
                blocked = blocked or e
                continue
            if both is not False:
                out.append(both)
            if len(out) == MAX_PRODUCT:  # the first combinations only: a narrowing that keeps the grammar small
                narrowing.note("anyOf", f"{pointer}/anyOf", f"only the first {MAX_PRODUCT} combinations of the "
                               "branches are kept")
                return out
    if not out and blocked is not None:
        raise blocked
    if not out:
        raise Empty("anyOf", pointer, "no pair of anyOf branches can match together")
    if blocked is not None:
        narrowing.note(blocked.keyword, blocked.pointer, f"a combination of anyOf branches is left out ({blocked.why})")
    return out


def _exclusion(pattern: Any) -> str | None:
    """The class content of a pattern `^[^...]*$` (strings without those characters), else None."""
    m = re.fullmatch(r"\^\[\^((?:\\.|[^\]\\])+)\]\*\$", pattern) if isinstance(pattern, str) else None
    return m.group(1) if m else None


def _alternatives(neg: Any) -> list[Any]:
    return list(neg["anyOf"]) if isinstance(neg, dict) and set(neg) == {"anyOf"} else [neg]


def _excluded(neg: Any) -> list[Any] | None:
    """The values a `not` of an enum/const excludes (None for any other `not`)."""
    if isinstance(neg, dict) and set(neg) == {"enum"} and isinstance(neg["enum"], list):
        return neg["enum"]
    if isinstance(neg, dict) and set(neg) == {"const"}:
        return [neg["const"]]
    return None


def _settle(node: dict[str, Any], pointer: str) -> None:
    """Resolve what merging left implicit: a `not` of values against the values the node allows (its enum/const,
    or a boolean/null type), a required property that must be absent (Empty), an empty enum (Empty)."""
    excluded = _excluded(node.get("not"))
    if excluded is not None:
        gone = {_json(v) for v in excluded}
        types = _types(node.get("type"))
        allowed = ([node["const"]] if "const" in node else node.get("enum") if isinstance(node.get("enum"), list)
                   else [True, False] if types == {"boolean"} else [None] if types == {"null"} else None)
        if allowed is not None:
            left = [v for v in allowed if _json(v) not in gone]
            del node["not"]
            node.pop("const", None)
            if len(left) == 1:
                node["const"] = left[0]
                node.pop("enum", None)
            else:
                node["enum"] = left
    types = _types(node.get("type"))
    if types and isinstance(node.get("enum"), list):
        node["enum"] = [v for v in node["enum"] if _value_type_ok(v, types)]
    if types and "const" in node and not _value_type_ok(node["const"], types):
        raise Empty("const", pointer, "the constant is not of the allowed types")
    _filter_values(node, pointer)
    if isinstance(node.get("enum"), list) and not node["enum"]:
        raise Empty("enum", pointer, "no value is allowed")
    if "const" in node and isinstance(node.get("enum"), list):
        if _json(node["const"]) not in {_json(v) for v in node["enum"]}:
            raise Empty("const", pointer, "the constant is not one of the enum values")
        del node["enum"]
    for low, high in zip(_LOWER, _UPPER):
        if _is_number(node.get(low)) and _is_number(node.get(high)) and (
                node[low] > node[high] or (node[low] == node[high] and "exclusive" in low + high)):
            raise Empty(low, pointer, f"{low} is above {high}")
    if node.get("items") is False and _is_number(node.get("minItems")) and node["minItems"] > len(
            node.get("prefixItems") or []):
        raise Empty("items", pointer, "more items are required than allowed")
    if _is_number(node.get("maxProperties")) and isinstance(node.get("required"), list) and len(
            set(node["required"])) > node["maxProperties"]:
        raise Empty("maxProperties", pointer, "more properties are required than allowed")
    props = node["properties"] if isinstance(node.get("properties"), dict) else {}
    closed = node.get("additionalProperties") is False and not node.get("patternProperties")
    for name in node["required"] if isinstance(node.get("required"), list) else ():
        if props.get(name) is False or (closed and name not in props):
            raise Empty("required", pointer, f"property {name!r} is both required and forbidden")


def _filter_values(node: dict[str, Any], pointer: str) -> None:
    """An enum/const next to string or number keywords (which the grammar ignores next to values) keeps only the
    values that satisfy them, checked with `jsonschema`, and the keywords go (exact)."""
    checks = {k: node[k] for k in _VALUE_CHECKED if k in node}
    values = [node["const"]] if "const" in node else node.get("enum")
    if not checks or not isinstance(values, list):
        return
    try:
        validator = Draft202012Validator(checks, format_checker=Draft202012Validator.FORMAT_CHECKER)
        kept = [v for v in values if validator.is_valid(v)]
    except (re.error, jsonschema.exceptions.SchemaError):
        return  # a pattern Python cannot read: left next to the values, and reported
    for key in checks:
        del node[key]
    if "const" in node and not kept:
        raise Empty("const", pointer, "the constant does not satisfy the keywords next to it")
    if "const" not in node:
        node["enum"] = kept


def _value_union(node: dict[str, Any]) -> None:
    """anyOf/oneOf whose branches only list values: one enum of the values (for oneOf, those of exactly one branch),
    exact, and far cheaper to merge than branches."""
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if not isinstance(branches, list) or not branches or "enum" in node or "const" in node or not all(
                isinstance(b, dict) and _constraints(b) in ({"enum"}, {"const"}) and isinstance(
                    b.get("enum", []), list) for b in branches):
            continue
        sets = [{_json(v): v for v in ([b["const"]] if "const" in b else b["enum"])} for b in branches]
        if key == "oneOf" and not all(isinstance(v, (str, bool)) or v is None for values in sets
                                      for v in values.values()):
            continue  # (1 and 1.0 are one value to JSON Schema: counted only for strings, booleans and null)
        counts: dict[str, int] = {}
        for values in sets:
            for text in values:
                counts[text] = counts.get(text, 0) + 1
        union = {text: v for values in sets for text, v in values.items()}
        del node[key]
        node["enum"] = [v for text, v in union.items() if key == "anyOf" or counts[text] == 1]
        return


def _applicable(node: dict[str, Any], name: str, pointer: str) -> Any:
    """The subschema `node` applies to property `name`: its `properties` entry and every matching
    `patternProperties` entry, or else `additionalProperties` (true when absent)."""
    parts = []
    if isinstance(node.get("properties"), dict) and name in node["properties"]:
        parts.append(node["properties"][name])
    for pattern, sub in (node.get("patternProperties") or {}).items():
        if _search(pattern, name, pointer):
            parts.append(sub)
    if not parts:
        return node.get("additionalProperties", True)
    out = parts[0]
    for sub in parts[1:]:
        out = _merge_sub(out, sub, pointer)
    return out


def _search(pattern: str, name: str, pointer: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        raise Unmergeable("patternProperties", pointer, f"pattern {pattern!r} cannot be matched here") from None


def _merge_object(a: dict[str, Any], b: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
    """The exact intersection of two objects' key rules: a key is allowed when both allow it, with the merge of
    what each applies to it (declared, matched by a pattern, or additional)."""
    if "unevaluatedProperties" in a and "unevaluatedProperties" in b and a[
            "unevaluatedProperties"] != b["unevaluatedProperties"]:
        raise Unmergeable("unevaluatedProperties", pointer, "unevaluatedProperties differs between branches and has "
                          "no exact intersection")
    if "unevaluatedProperties" in a or "unevaluatedProperties" in b:
        out["unevaluatedProperties"] = _copy(a.get("unevaluatedProperties", b.get("unevaluatedProperties")))
    if "propertyNames" in a or "propertyNames" in b:  # every name must match both
        out["propertyNames"] = _merge_sub(a.get("propertyNames", True), b.get("propertyNames", True),
                                          f"{pointer}/propertyNames")
    names = [*(a.get("properties") or {}), *(b.get("properties") or {})]
    if names:
        out["properties"] = {name: _merge_or_false(_applicable(a, name, pointer), _applicable(b, name, pointer),
                                                   f"{pointer}/properties/{pointer_token(name)}")
                             for name in dict.fromkeys(names)}
    pa, pb = a.get("patternProperties") or {}, b.get("patternProperties") or {}
    extra_a, extra_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
    if pa and pb and set(pa) != set(pb):
        if not (_is_true(extra_a) and _is_true(extra_b)):
            raise Unmergeable("patternProperties", pointer, "different patternProperties next to "
                              "additionalProperties have no exact intersection")
        extra_a = extra_b = True  # a key matching a pattern of one side only is free on the other
    patterns = {p: _merge_or_false(pa.get(p, extra_a), pb.get(p, extra_b),
                                   f"{pointer}/patternProperties/{pointer_token(p)}")
                for p in dict.fromkeys([*pa, *pb])}
    extra = _merge_or_false(a.get("additionalProperties", True), b.get("additionalProperties", True),
                            f"{pointer}/additionalProperties")
    out.pop("patternProperties", None)
    out.pop("additionalProperties", None)
    if extra is False:  # a pattern nothing may match is then the same as no pattern
        patterns = {p: sub for p, sub in patterns.items() if sub is not False}
    if patterns:
        out["patternProperties"] = patterns
    if "additionalProperties" in a or "additionalProperties" in b:
        out["additionalProperties"] = extra


def _merge_tuple(a: dict[str, Any], b: dict[str, Any], out: dict[str, Any], pointer: str) -> None:
    """prefixItems/items of two arrays: item i gets both sides' schema for position i (a side's `items` where its
    prefix is shorter), the rest both `items`."""
    pa, pb = a.get("prefixItems") or [], b.get("prefixItems") or []
    ia, ib = a.get("items", True), b.get("items", True)
    out["prefixItems"] = [_merge_or_false(pa[i] if i < len(pa) else ia, pb[i] if i < len(pb) else ib,
                                          f"{pointer}/prefixItems/{i}") for i in range(max(len(pa), len(pb)))]
    out.pop("items", None)
    if "items" in a or "items" in b:
        out["items"] = _merge_or_false(ia, ib, f"{pointer}/items")
    if False in out["prefixItems"]:  # no array can hold an item there: it ends before
        end = out["prefixItems"].index(False)
        out["prefixItems"] = out["prefixItems"][:end]
        out["items"] = False
        out["maxItems"] = min(out.get("maxItems", end), end)


def _is_true(sub: Any) -> bool:
    return sub is True or (isinstance(sub, dict) and not _constraints(sub))


def _extra_keys(mine: Any, other: Any) -> list[dict[str, Any]]:
    """Instances of `mine` outside the closed object `other`: those with a key `mine` declares and `other` lacks."""
    if not (isinstance(mine, dict) and isinstance(other, dict)) or other.get("additionalProperties") is not False \
            or other.get("patternProperties") or not isinstance(mine.get("properties"), dict):
        return []
    theirs = other["properties"] if isinstance(other.get("properties"), dict) else {}
    return [{"type": "object", "required": [k]} for k in mine["properties"] if k not in theirs]


def _remote(schema: Any) -> bool:
    """Does `schema` use a `$ref` to another document (which is not fetched)?"""
    if isinstance(schema, list):
        return any(_remote(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    if isinstance(schema.get("$ref"), str) and not schema["$ref"].startswith("#"):
        return True
    return any(_remote(v) for k, v in schema.items() if k not in ("enum", "const", "default", "examples"))


def _alternatives_of(schema: Any) -> list[Any]:
    """The branches of a bare anyOf, or the schema itself."""
    if isinstance(schema, dict) and set(schema) == {"anyOf"} and isinstance(schema["anyOf"], list):
        return list(schema["anyOf"])
    return [schema]


def _without_shared_types(branches: list[Any]) -> list[Any]:
    """oneOf branches narrowed by the type names another branch also lists (["string", "null"] and
    ["integer", "null"] become "string" and "integer": a null would match both, so it was never valid)."""
    lists = [_types(b.get("type")) if isinstance(b, dict) else None for b in branches]
    out = []
    for i, branch in enumerate(branches):
        mine = lists[i]
        shared = set().union(*(t for j, t in enumerate(lists) if j != i and t)) if mine else set()
        if not mine or not mine & shared or not mine - shared:
            out.append(branch)  # (all types shared: other keywords may still tell the branches apart)
        else:
            rest = sorted(mine - shared)
            out.append({**branch, "type": rest[0] if len(rest) == 1 else rest})
    return out


def _is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _json(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


class _Rewritten:
    """A node's rewrite kept for reuse: its result as JSON text (or the Empty it raised), the findings it made, and
    the references it inlined."""

    def __init__(self, pointer: str, refs: set[str], findings: list[Unmergeable], narrowed: list[narrowing.Narrowing],
                 result: str = "", empty: Empty | None = None) -> None:
        self.pointer, self.refs, self.findings, self.result, self.empty = pointer, refs, list(findings), result, empty
        self.narrowed = narrowed

    def _moved(self, e: Unmergeable, pointer: str) -> Unmergeable:
        where = pointer + e.pointer[len(self.pointer):] if e.pointer.startswith(self.pointer) else e.pointer
        return type(e)(e.keyword, where, e.why)

    def replay(self, findings: list[Unmergeable], pointer: str) -> Any:
        """The kept result for the node now at `pointer` (its findings appended there), or its Empty raised."""
        findings.extend(self._moved(e, pointer) for e in self.findings)
        narrowing.extend([n.moved(self.pointer, pointer) for n in self.narrowed])
        if self.empty is not None:
            raise self._moved(self.empty, pointer)
        return json.loads(self.result)


class Normalizer:
    """One pass over a schema; `findings` collects what could not be rewritten (left as it was)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.findings: list[Unmergeable] = []
        self._inlining: list[str] = []
        self._validator: Any = None
        self._visits = 0
        self._memo: dict[tuple[str, bool], _Rewritten] = {}
        self._resolved: list[str] = []  # every reference inlined so far, in order
        self._recursions = 0  # recursive references met so far (their outcome depends on the inlining stack)
        self._nothing: dict[str, bool] = {}  # reference -> whether its target matches no instance (being checked: no)

    def run(self) -> dict[str, Any]:
        self.root = _copy(self.root)
        dialect = self.root.get("$schema")
        _draft_forms(self.root, isinstance(dialect, str) and _REF_ALONE.match(dialect) is not None)  # (merges read subschemas before they are visited: every one in 2020-12 form first)
        return self.node(_copy(self.root), "")

    def _resolve(self, ref: str, pointer: str) -> dict[str, Any]:
        """A local `$ref` target, normalized, for merging (recursion cannot be merged)."""
        if not (ref == "#" or ref.startswith("#/")):
            raise Unmergeable("$ref", pointer, f"only references within this document are followed, not {ref!r}")
        self._resolved.append(ref)
        if ref in self._inlining:
            self._recursions += 1
            raise Unmergeable("$ref", pointer, f"recursive reference {ref} cannot be merged with other keywords")
        try:
            target = self._lookup(ref)
        except Unmergeable:
            raise Unmergeable("$ref", pointer, f"reference {ref} does not resolve") from None
        if not isinstance(target, dict):
            raise Unmergeable("$ref", pointer, f"reference {ref} is not an object schema")
        self._inlining.append(ref)
        try:
            out = self.node(_copy(target), ref[1:])
            if isinstance(out, dict) and isinstance(out.get("$ref"), str):  # a reference to a reference
                out = _merge(self._resolve(out["$ref"], pointer), {k: v for k, v in out.items() if k != "$ref"},
                             pointer)
            return out
        finally:
            self._inlining.pop()

    def _branch(self, branch: Any, pointer: str) -> dict[str, Any]:
        if branch is True:
            return {}
        if not isinstance(branch, dict):
            raise Empty("allOf", pointer, "a false branch matches nothing")
        branch = self.node(branch, pointer, member=True)
        ref = branch.get("$ref")
        if isinstance(ref, str):
            rest = {k: v for k, v in branch.items() if k != "$ref"}
            return _closed(_merge(self._resolve(ref, pointer), rest, pointer), pointer)
        return _closed(branch, pointer)

    def node(self, node: Any, pointer: str, member: bool = False) -> Any:
        """The rewritten `node`; with `member` (an anyOf/oneOf branch, a property, an item), a node that no instance
        can match raises Empty, for the caller to drop or forbid, instead of being reported.

        Merging copies subschemas into every branch they apply to, so the same text is rewritten again and again:
        the rewrite of a large node is kept by its text and reused (its findings replayed at the new pointer) unless
        it inlined a reference that is being inlined now (the recursion would then be cut elsewhere)."""
        if not isinstance(node, dict):
            return node
        key = (json.dumps(node), member)
        if len(key[0]) < MEMO_MIN_CHARS:
            return self._rewrite(node, pointer, member)
        done = self._memo.get(key)
        if done is not None and not done.refs & set(self._inlining):
            return done.replay(self.findings, pointer)
        mark, resolved, recursions = len(self.findings), len(self._resolved), self._recursions
        nmark = narrowing.mark()
        try:
            out = self._rewrite(node, pointer, member)
        except Empty as e:
            if self._recursions == recursions:
                self._memo[key] = _Rewritten(pointer, set(self._resolved[resolved:]), self.findings[mark:],
                                             narrowing.since(nmark), empty=e)
            raise
        if self._recursions == recursions:
            self._memo[key] = _Rewritten(pointer, set(self._resolved[resolved:]), self.findings[mark:],
                                         narrowing.since(nmark), json.dumps(out))
        return out

    def _rewrite(self, node: dict[str, Any], pointer: str, member: bool) -> Any:
        self._visits += 1
        if self._visits > MAX_VISITS:
            raise TooComplex(f"rewriting visits more than {MAX_VISITS} subschemas")
        self._draft04(node)
        _value_union(node)
        try:
            if isinstance(node.get("$ref"), str) and self._matches_nothing(node["$ref"]):
                raise Empty("$ref", f"{pointer}/$ref", f"the target of {node['$ref']} matches no value")
            _close_unevaluated(node, pointer)
            self._conditional(node, pointer)
            _dependencies(node)
            if _unique_tuples(node):
                narrowing.note("uniqueItems", f"{pointer}/uniqueItems", "held to the arrays of distinct values of "
                               "the prefixItems (no item after them)")
            if self._contains_at(node):
                narrowing.note("contains", f"{pointer}/contains", f"enforced where one of the first "
                               f"{MAX_CONTAINS_AT} items matches it")
            self._negation(node, pointer)
            node = self._applicators(node, pointer)
            _settle(node, pointer)
            if isinstance(node.get("pattern"), str) and not whole_string(node["pattern"]):
                narrowing.note("pattern", f"{pointer}/pattern", "matched against the whole string (JSON Schema "
                               "searches it)")
            if node.get("format") in SUPPORTED_FORMATS:
                narrowing.note("format", f"{pointer}/format", f"asserted: strings are valid {node['format']} "
                               "(JSON Schema's default is an annotation only)")
            for keyword, why in narrow_strings(node):
                narrowing.note(keyword, f"{pointer}/{keyword}", why)
        except Unmergeable as e:
            if member and isinstance(e, Empty):
                raise
            self.findings.append(e)
        if _unique_items(node):
            narrowing.note("uniqueItems", f"{pointer}/uniqueItems", "enforced as maxItems 1 (a grammar cannot "
                           "exclude duplicate items)")
        counted = (node.get("minContains", 1), "maxContains" in node)
        if _contains(node, self._negate):
            narrowing.note("contains", f"{pointer}/contains", f"enforced on the first {counted[0]} item(s)"
                           + (", no later item matching it (maxContains)" if counted[1] else ""))
        self._unevaluated(node, pointer)
        self._one_of(node, pointer)
        branch = _BRANCH.search(pointer) is not None and "/propertyNames" not in pointer  # (names: strings)
        self._infer_type(node, every_type="/propertyNames" not in pointer)
        _multiple_of(node, pointer, every_type=branch)
        self._filter_enum(node)
        required = set(node["required"]) if isinstance(node.get("required"), list) else set()
        for key in ("additionalProperties", "propertyNames", "items", "unevaluatedProperties", "unevaluatedItems",
                    "not", "if", "then", "else", "contains"):
            if isinstance(node.get(key), dict):
                node[key] = self._member(node[key], f"{pointer}/{key}", key in ("additionalProperties", "items"),
                                         False)
        if isinstance(node.get("properties"), dict):  # an optional property whose schema is remote: left out
            for name, sub in list(node["properties"].items()):
                if name not in required and _remote(sub):
                    node["properties"][name] = False
                    narrowing.note("$ref", f"{pointer}/properties/{pointer_token(name)}", "an optional property "
                                   "whose schema is in another document is left out")
        for key in ("properties", "patternProperties", "dependentSchemas"):
            if isinstance(node.get(key), dict):
                node[key] = {name: self._member(sub, f"{pointer}/{key}/{pointer_token(name)}", key in (
                    "properties", "patternProperties") and name not in required, member and key == "properties")
                    for name, sub in node[key].items()}
        for key in DEFS:
            if isinstance(node.get(key), dict):
                node[key] = self._definitions(node[key], f"{pointer}/{key}")
        if isinstance(node.get("allOf"), list):
            node["allOf"] = [self.node(sub, f"{pointer}/allOf/{i}") for i, sub in enumerate(node["allOf"])]
        if isinstance(node.get("prefixItems"), list):
            self._prefix(node, pointer, member)
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                node[key] = self._branches(node[key], f"{pointer}/{key}", member)
        return node

    def _definitions(self, defs: dict[str, Any], pointer: str) -> dict[str, Any]:
        """Definitions rewritten, folders of definitions (`#/$defs/plugins/extractor`) included: a `$ref` into one
        is compiled from the rewritten text. One that matches no value goes: every reference to it matches nothing
        (the node holding it is dropped or forbidden where it may be, refused otherwise)."""
        out = {name: self._definitions(sub, f"{pointer}/{pointer_token(name)}") if is_folder(sub)
               else self._member(sub, f"{pointer}/{pointer_token(name)}", True, False) for name, sub in defs.items()}
        return {name: sub for name, sub in out.items() if sub is not False}

    def _matches_nothing(self, ref: str) -> bool:
        """Does the target of `ref` match no instance at all (a trial rewrite raises Empty)? Whatever the trial
        noted is taken back; a reference met again while its target is being checked counts as matching."""
        if ref not in self._nothing:
            self._nothing[ref] = False
            try:
                target = self._lookup(ref)
            except Unmergeable:
                return False
            mark, nmark = len(self.findings), narrowing.mark()
            try:
                self.node(_copy(target), ref[1:], member=True)
            except Empty:
                self._nothing[ref] = True
            except Unmergeable:
                pass
            del self.findings[mark:]
            narrowing.rollback(nmark)
        return self._nothing[ref]

    def _prefix(self, node: dict[str, Any], pointer: str, member: bool) -> None:
        """prefixItems rewritten; at the first that no instance matches, the array ends (Empty if it may not)."""
        out = []
        for i, sub in enumerate(node["prefixItems"]):
            item = self._member(sub, f"{pointer}/prefixItems/{i}", True, False)
            if item is False:
                node["items"] = False
                node["maxItems"] = min(node.get("maxItems", i), i)
                break
            out.append(item)
        node["prefixItems"] = out
        try:
            _settle(node, pointer)
        except Empty as e:
            if member:
                raise
            self.findings.append(e)

    def _member(self, sub: Any, pointer: str, optional: bool, propagate: bool) -> Any:
        """A subschema rewritten; one that matches nothing becomes `false` where the member is optional, and
        otherwise makes its parent empty (`propagate`) or is reported."""
        mark, nmark = len(self.findings), narrowing.mark()
        try:
            return self.node(sub, pointer, member=True)
        except Empty as e:
            del self.findings[mark:]
            narrowing.rollback(nmark)
            if optional:
                return False
            if propagate:
                raise
            self.findings.append(e)
            return sub

    def _branches(self, branches: list[Any], pointer: str, member: bool) -> list[Any]:
        """anyOf/oneOf branches rewritten; those that match nothing are dropped (they never matched)."""
        kept = []
        for i, sub in enumerate(branches):
            mark, nmark = len(self.findings), narrowing.mark()
            try:
                kept.append(self.node(sub, f"{pointer}/{i}", member=True))
            except Empty:
                del self.findings[mark:]
                narrowing.rollback(nmark)
        if kept:
            return kept
        empty = Empty(pointer.rsplit("/", 1)[-1], pointer, "no branch can match")
        if member:
            raise empty
        self.findings.append(empty)
        return branches

    @staticmethod
    def _draft04(node: dict[str, Any]) -> None:
        for excl, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(excl), bool):
                if node.pop(excl) and bound in node:
                    node[excl] = node.pop(bound)
        if isinstance(node.get("items"), list):
            node["prefixItems"] = node.pop("items")
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
        elif "additionalItems" in node:
            node.pop("additionalItems")  # ignored by every draft when items is not an array

    def _conditional(self, node: dict[str, Any], pointer: str) -> None:
        """`if`/`then`/`else` as the allOf branch anyOf[if and then, not-if and else] (not-if: see
        schema_complement; where only a part of it is expressible, the else side is narrowed to that part)."""
        if "if" not in node:
            node.pop("then", None)
            node.pop("else", None)  # without `if` they have no effect
            return
        cond, then, other = node.pop("if"), node.pop("then", True), node.pop("else", True)
        branches, blocked = [], None
        with narrowing.lost_negations() as lost:
            negated = complement(cond, self._lookup)
        if lost and other is not False:
            narrowing.note("if", f"{pointer}/if", "the else side applies to a part of the instances failing the "
                           f"condition only ({', '.join(dict.fromkeys(lost))} has no negation)")
        for part, sub in ((cond, then), (negated, other)):
            if part is None:
                continue
            try:
                both = _merge_sub(part, sub, f"{pointer}/if")
            except Empty:
                continue
            except Unmergeable as e:
                blocked = e
                continue
            if both is not False:
                branches.append(both if isinstance(both, dict) else {})
        if not branches:
            why = f" ({blocked.keyword}: {blocked.why})" if blocked else ""
            raise Unmergeable("if", f"{pointer}/if", f"neither branch of the condition can be enforced{why}")
        node.setdefault("allOf", []).append({"anyOf": branches} if len(branches) > 1 else branches[0])

    def _negation(self, node: dict[str, Any], pointer: str) -> None:
        """`not` S as the allOf branch complement(S) (a `not` of values stays: merging resolves it)."""
        if "not" not in node or _excluded(node["not"]) is not None:
            return
        if _is_true(node["not"]):
            raise Empty("not", f"{pointer}/not", "not of a schema every value matches: no value matches")
        with narrowing.lost_negations() as lost:
            neg = complement(node["not"], self._lookup)
        if neg is None:
            return  # left in place: reported as not enforced
        if lost:
            narrowing.note("not", f"{pointer}/not", f"a part of the negation only ({', '.join(dict.fromkeys(lost))} "
                           "has no negation)")
        del node["not"]
        node.setdefault("allOf", []).append(neg)

    def _applicators(self, node: dict[str, Any], pointer: str) -> dict[str, Any]:
        unevaluated = node.pop("unevaluatedProperties", None) if (
            "$ref" in node or "allOf" in node) and "unevaluatedProperties" in node else None
        ref = node.get("$ref")
        if isinstance(ref, str) and unevaluated is None:
            self._implied_by_target(node, ref)
        if isinstance(ref, str) and (_constraints(node) - {"$ref"} or unevaluated is not None):
            rest = {k: v for k, v in node.items() if k != "$ref"}
            node = _merge(self._resolve(ref, f"{pointer}/$ref"), rest, pointer)
        if isinstance(node.get("allOf"), list):
            branches = node.pop("allOf")
            for i, branch in enumerate(branches):
                node = _merge(node, self._branch(branch, f"{pointer}/allOf/{i}"), f"{pointer}/allOf/{i}")
        if unevaluated is not None:
            # merged into one schema: the keys the branches evaluated are its properties and patterns, and every
            # key when one of them had additionalProperties (kept then); otherwise it becomes additionalProperties
            if any(k in node for k in ("anyOf", "oneOf", "$ref")) or "additionalProperties" not in node:
                node["unevaluatedProperties"] = unevaluated
        if isinstance(node.get("oneOf"), list) and isinstance(node.get("anyOf"), list):
            keep = self._exclusive(node["oneOf"], pointer)
            if keep:  # oneOf narrowed to its exclusive branches is an anyOf: the two are distributed
                del node["oneOf"]
                node["anyOf"] = _distribute(node["anyOf"], keep, f"{pointer}/oneOf")
        for key in ("anyOf", "oneOf"):
            siblings = _constraints(node) - {key}
            if isinstance(node.get(key), list) and siblings:
                if len([k for k in _APPLICATORS if k in node]) > 1:
                    raise Unmergeable(key, f"{pointer}/{key}", "anyOf and oneOf in one schema are not merged")
                shared = {k: v for k, v in node.items() if k in siblings}
                for uneval in ("unevaluatedProperties", "unevaluatedItems"):
                    if uneval in shared and len(node[key]) > 1:
                        narrowing.note(uneval, f"{pointer}/{uneval}", f"applied in each {key} branch: a member "
                                       "evaluated only by another matching branch is not admitted")
                merged, blocked, left_out = [], None, []
                for i, branch in enumerate(node[key]):
                    mark, nmark = len(self.findings), narrowing.mark()
                    try:
                        merged.append(_merge(shared, self._branch(branch, f"{pointer}/{key}/{i}"),
                                             f"{pointer}/{key}/{i}"))
                    except Empty:
                        del self.findings[mark:]
                        narrowing.rollback(nmark)
                        continue  # no instance matches this branch and its siblings: it adds nothing
                    except Unmergeable as e:  # no exact merge: the branch is left out (a narrowing) if another stays
                        del self.findings[mark:]
                        narrowing.rollback(nmark)
                        blocked = blocked or e
                        left_out.append(e)
                if not merged and blocked is not None:
                    raise blocked
                for gap in left_out:
                    narrowing.note(key, gap.pointer, f"a branch is left out: {gap.why}")
                if not merged:
                    raise Empty(key, f"{pointer}/{key}", "no branch is compatible with the keywords next to it")
                node = {k: v for k, v in node.items() if k not in siblings}
                node[key] = merged
        return node

    def relocate_refs(self, out: dict[str, Any]) -> None:
        """`$ref`s into a place the rewrite may have moved (`#/definitions/step/oneOf/1/properties/run`: the oneOf
        became an anyOf) point to a copy of their rewritten target among `out`'s definitions instead."""
        folder = "definitions" if "definitions" in out else "$defs"
        moved: dict[str, str] = {}

        def walk(node: Any) -> None:
            if isinstance(node, list):
                for item in node:
                    walk(item)
            if not isinstance(node, dict):
                return
            ref = node.get("$ref")
            if isinstance(ref, str) and not self._stable(ref):
                if ref not in moved:
                    try:
                        target = self._resolve(ref, "")
                    except Unmergeable:
                        target = None  # (reported where it is used)
                    if target is not None:
                        moved[ref] = name = f"edgellm-ref-{len(moved)}"
                        out.setdefault(folder, {})[name] = target
                        walk(target)
                if ref in moved:
                    node["$ref"] = f"#/{folder}/{moved[ref]}"
            for key, value in list(node.items()):  # (a copy: definitions may be added meanwhile)
                if key not in ("enum", "const", "default", "examples"):
                    walk(value)

        walk(out)

    def _stable(self, ref: str) -> bool:
        """A reference the rewrite keeps valid: the root, or a definition (in folders of definitions)."""
        if ref == "#":
            return True
        parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")] if ref.startswith("#/") else []
        if len(parts) < 2 or parts[0] not in DEFS:
            return False
        node: Any = self.root.get(parts[0])
        for part in parts[1:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if not is_folder(node):
                return False
        return True

    def _implied_by_target(self, node: dict[str, Any], ref: str) -> None:
        """Keywords next to a `$ref` that its target has with the same value go (exact): the reference stays a
        reference instead of a merged copy of its target."""
        try:
            target = self._lookup(ref)
        except Unmergeable:
            return
        if isinstance(target, dict) and "$ref" not in target and all(  # (a target that refers on could come back)
                k in target and target[k] == node[k] for k in _constraints(node) - {"$ref"}):
            for key in _constraints(node) - {"$ref"}:
                del node[key]

    def _one_of(self, node: dict[str, Any], pointer: str) -> None:
        """oneOf branches that provably exclude every other branch are kept (as anyOf, which the grammar enforces);
        the others are dropped — an instance of a kept branch matches exactly one branch, so this only narrows."""
        branches = node.get("oneOf")
        if not isinstance(branches, list) or not branches or "anyOf" in node:
            return
        keep = self._exclusive(branches, pointer) if len(branches) > 1 else branches  # one excludes no other
        if keep:
            del node["oneOf"]
            node["anyOf"] = keep

    def _exclusive(self, branches: list[Any], pointer: str) -> list[Any]:
        """oneOf branches made mutually exclusive: kept as they are where they provably exclude every other branch,
        otherwise narrowed by the negation of each branch they may overlap (schema_complement), or dropped."""
        narrowed = _without_shared_types(branches)
        seen = [self._seen(b) for b in narrowed]
        original = [self._seen(b) for b in branches]
        out = []
        for i, branch in enumerate(narrowed):
            overlapping = [branches[j] for j in range(len(branches))
                           if j != i and not self._disjoint(seen[i], original[j], 3)]
            with narrowing.lost_negations() as lost:
                branch = self._excluding(branch, overlapping) if overlapping else branch
            if branch is not None and not _has_negation(branch):  # (a `not` left unresolved: cannot exclude)
                out.append(branch)
                if lost:
                    narrowing.note("oneOf", f"{pointer}/oneOf/{i}", "the branch is held to a part of where it "
                                   f"excludes the others ({', '.join(dict.fromkeys(lost))} has no negation)")
            else:
                narrowing.note("oneOf", f"{pointer}/oneOf/{i}", "the branch is left out: its exclusion of the "
                               "branches it may overlap has no grammar form")
        return out

    def _excluding(self, branch: Any, others: list[Any]) -> Any:
        """`branch` and not any of `others` (a part of it where a negation has no grammar form); None if nothing."""
        if not isinstance(branch, dict):
            return None
        alternatives = [branch]  # branch and the negations so far, as a union of merged schemas
        for other in others:
            parts = [q for p in (complement(other, self._lookup, max_parts=MAX_NEGATION_PARTS, patterns=True),
                                 *_extra_keys(self._seen(branch), self._seen(other))) if p is not None
                     for q in _alternatives_of(p)]
            merged = []
            for alternative in alternatives:
                for part in parts:
                    try:
                        merged.append(_merge(alternative, part, ""))
                    except Empty:
                        continue
                    except Unmergeable:  # no exact merge: left out (narrowing)
                        narrowing.lose("oneOf")
                        continue
            if not merged:
                return None
            if len(merged) > MAX_NEGATION_PARTS ** 2:
                narrowing.lose("oneOf")
            alternatives = merged[:MAX_NEGATION_PARTS ** 2]  # the first combinations only (a narrowing)
        branch = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
        # (rewritten again where it is used: reused from the memo)
        return branch if self._rewrites(branch) else None  # a negation the rewrite cannot merge: dropped (narrowing)

    def _contains_at(self, node: dict[str, Any]) -> bool:
        """`contains` S (minContains 1, maxContains absent or 1) as the allOf branch "the first item matching S is
        item k", k below MAX_CONTAINS_AT: the items before it held to the complement of S (and, under maxContains 1,
        those after it). Exact for arrays whose first match is among those items; True where arrays may be longer
        (a narrowing). Other shapes are left to _contains."""
        sub = node.get("contains")
        if not isinstance(sub, dict) or "unevaluatedItems" in node or node.get("minContains", 1) != 1 or node.get(
                "maxContains") not in (None, 1):
            return False
        prefix = node["prefixItems"] if isinstance(node.get("prefixItems"), list) else []
        if not any(_can_merge(prefix[k] if k < len(prefix) else node.get("items", True), sub)
                   for k in range(MAX_CONTAINS_AT)):
            return False  # (no item can match it: _contains names it)
        neg = self._negate(sub)
        if neg is None:
            return False
        others = sorted((_types(node.get("type")) or set(_ALL_TYPES)) - {"array"})
        branches: list[Any] = [{"type": others}] if others else []
        for k in range(MAX_CONTAINS_AT):
            branch = {"type": "array", "prefixItems": [*(_copy(neg) for _ in range(k)), _copy(sub)], "minItems": k + 1}
            if node.get("maxContains") == 1:
                branch["items"] = _copy(neg)
            branches.append(branch)
        for key in ("contains", "minContains", "maxContains"):
            node.pop(key, None)
        node.setdefault("allOf", []).append({"anyOf": branches})
        return not (_is_number(node.get("maxItems")) and node["maxItems"] <= MAX_CONTAINS_AT)

    def _negate(self, schema: Any) -> Any:
        """A part of the complement of `schema` (complement()) that the rewrite can enforce, None when it has none."""
        with narrowing.lost_negations():
            neg = complement(schema, self._lookup)
        return neg if neg is not None and self._rewrites(neg, negation_free=True) else None

    def _rewrites(self, schema: Any, *, negation_free: bool = False) -> bool:
        """Whether `schema`, rewritten as a member, needs nothing reported (and, with `negation_free`, keeps no
        negation); what the trial noted is taken back either way."""
        mark, nmark = len(self.findings), narrowing.mark()
        try:
            rewritten = self.node(_copy(schema), "", member=True)
            ok = len(self.findings) == mark and not (negation_free and _has_negation(rewritten))
        except Unmergeable:
            ok = False
        del self.findings[mark:]
        narrowing.rollback(nmark)
        return ok

    def _seen(self, branch: Any) -> Any:
        """A branch with its top-level local $ref followed (for the disjointness test only)."""
        for _ in range(8):
            if not (isinstance(branch, dict) and isinstance(branch.get("$ref"), str)):
                break
            try:
                target = self._lookup(branch["$ref"])
            except Unmergeable:
                return branch
            rest = {k: v for k, v in branch.items() if k != "$ref"}
            branch = {**target, **rest}
        return branch

    def _lookup(self, ref: str) -> Any:
        if not (ref == "#" or ref.startswith("#/")):
            raise Unmergeable("$ref", "", ref)
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]  # (an index into anyOf/oneOf/allOf/prefixItems)
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise Unmergeable("$ref", "", ref)
        return target

    def _valid(self, value: Any, schema: Any) -> bool | None:
        """Does `value` validate under `schema` (refs resolved in the root)? None when that cannot be decided."""
        try:
            if self._validator is None:
                from jsonschema.validators import validator_for

                self._validator = validator_for(self.root)(self.root)
            return bool(self._validator.evolve(schema=schema).is_valid(value))
        except Exception:  # noqa: BLE001 - an unresolvable reference, a bad regex: not provably disjoint
            return None

    def _disjoint(self, a: Any, b: Any, depth: int) -> bool:
        """True only when no instance can match both `a` and `b`."""
        if not (isinstance(a, dict) and isinstance(b, dict)) or depth == 0:
            return False
        ta, tb = _types(a.get("type")), _types(b.get("type"))
        if ta is not None and tb is not None:
            grow = lambda t: t | ({"integer"} if "number" in t else set())  # noqa: E731
            if not grow(ta) & grow(tb):
                return True
        for x, y in ((a, b), (b, a)):
            values = [x["const"]] if "const" in x else x.get("enum")
            if isinstance(values, list) and all(self._valid(v, y) is False for v in values):
                return True
            branches = x.get("anyOf", x.get("oneOf"))  # every instance of x matches one of its branches
            if isinstance(branches, list) and branches and all(self._disjoint(self._seen(sub), y, depth - 1)
                                                               for sub in branches):
                return True
        pa, pb = a.get("properties", {}), b.get("properties", {})
        if isinstance(pa, dict) and isinstance(pb, dict):
            both = set(a.get("required", [])) & set(b.get("required", []))
            if any(name in pa and name in pb and self._disjoint(self._seen(pa[name]), self._seen(pb[name]), depth - 1)
                   for name in both):
                return True
            for x, y, px, py in ((a, b, pa, pb), (b, a, pb, pa)):
                closed = y.get("additionalProperties") is False and "patternProperties" not in y
                if closed and any(name not in py for name in x.get("required", [])):
                    return True
        return False

    def _unevaluated(self, node: dict[str, Any], pointer: str) -> None:
        applied = any(k in node for k in (*_APPLICATORS, "$ref", "if", "dependentSchemas"))
        for key, plain in (("unevaluatedProperties", "additionalProperties"), ("unevaluatedItems", "items")):
            if key in node:
                if applied:
                    self.findings.append(Unmergeable(key, f"{pointer}/{key}", f"{key} next to anyOf/oneOf/allOf/$ref "
                                                     "depends on what the branches evaluate; not enforced"))
                elif plain not in node:
                    node[plain] = node.pop(key)
                else:
                    node.pop(key)  # additionalProperties / items already cover every unevaluated member

    @staticmethod
    def _infer_type(node: dict[str, Any], every_type: bool = True) -> None:
        """A type for a node without one (the grammar ignores most keywords of an untyped schema): every JSON type,
        each keyword then applying to its own type only, as JSON Schema says (exact: `{"minLength": 2}` accepts
        numbers); without `every_type` (a property name, always a string) the types its keywords belong to."""
        if "type" in node or any(k in node for k in ("$ref", "const", "enum", *_APPLICATORS)):
            return
        kinds = [kind for kind, words in FAMILIES.items() if words & set(node)]
        if kinds and every_type:
            node["type"] = list(_ALL_TYPES)
        elif kinds:
            node["type"] = kinds[0] if len(kinds) == 1 else kinds

    @staticmethod
    def _filter_enum(node: dict[str, Any]) -> None:
        types = _types(node.get("type"))
        if types and isinstance(node.get("enum"), list):
            node["enum"] = [v for v in node["enum"] if _value_type_ok(v, types)]


def _dependencies(node: dict[str, Any]) -> None:
    """`dependentRequired` / `dependentSchemas` / draft-07 `dependencies` {k: D} as the allOf branch
    anyOf[k absent, k present and D] (exact)."""
    for key in ("dependentRequired", "dependentSchemas", "dependencies"):
        deps = node.get(key)
        if not isinstance(deps, dict) or not all(isinstance(d, (list, bool, dict)) for d in deps.values()):
            continue
        del node[key]
        for name, dep in deps.items():
            then = {"required": list(dep)} if isinstance(dep, list) else dep
            if then is True or then == {"required": []}:
                continue
            present = {"required": [name]} if then is False else {**(then or {}), "required": [
                name, *(then.get("required", []) if isinstance(then.get("required"), list) else [])]}
            absent = {"properties": {name: False}}
            node.setdefault("allOf", []).append({"anyOf": [absent] if then is False else [absent, present]})


def _draft_forms(node: Any, ref_alone: bool = False) -> None:
    """Every subschema of `node` in the 2020-12 forms of draft-04..2019-09 keywords (Normalizer._draft04), in place;
    with `ref_alone` (draft-07 and earlier), the assertions next to a `$ref` go, as those drafts ignore them."""
    if not isinstance(node, dict):
        return
    if ref_alone and "$ref" in node:
        for key in [k for k in node if k != "$ref" and k in ASSERTIONS]:
            del node[key]
    Normalizer._draft04(node)
    _boolean_forms(node)
    for child, _ in _children(node, ""):
        _draft_forms(child, ref_alone)
    for key in ("not", "if", "then", "else", "unevaluatedProperties"):
        _draft_forms(node.get(key), ref_alone)
    for key in ("dependentSchemas", "dependencies"):
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                _draft_forms(sub, ref_alone)


# xgrammar (0.2.9) enforces an integer multipleOf up to this step and silently ignores a larger one (probed).
MAX_GRAMMAR_STEP = 1024
MAX_MULTIPLES = 256  # a larger step within bounds is written as the enum of its multiples, up to this many


def _fraction(value: float) -> Fraction:
    """The decimal a JSON number spells, exactly (0.1 is 1/10, not the binary float nearest to it)."""
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def _multiple_of(node: dict[str, Any], pointer: str, every_type: bool = False) -> None:
    """multipleOf as the grammar enforces it: an integer step on integers. The integer multiples of a/b (reduced) are
    the multiples of a, so a fractional step becomes a's (exact on integers; on numbers the non-integral multiples
    are lost, a narrowing, noted), and a number multiple of an integer is an integer (exact). A step above what
    xgrammar enforces is written as the enum of its multiples within the bounds, or left (refused)."""
    m, types = node.get("multipleOf"), _types(node.get("type"))
    if not _is_number(m) or m <= 0 or not types or not types & {"integer", "number"}:
        return
    q = _fraction(m)
    step = q.numerator
    if "number" in types and q.denominator > 1 and not every_type:
        narrowing.note("multipleOf", f"{pointer}/multipleOf", f"held to the integer multiples of {m} (multiples of "
                       f"{step})")
    elif "number" in types and q.denominator > 1:
        return  # (a branch: merged into its context first)
    node["type"] = sorted(types - {"number"} | {"integer"}) if len(types) > 1 else "integer"
    if node["type"] == ["integer"]:
        node["type"] = "integer"
    node["multipleOf"] = step
    bounds: dict[str, Any] = {k: node[k] for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
                              if k in node}
    if step == 1:
        del node["multipleOf"]
    elif (bounds or step > MAX_GRAMMAR_STEP) and _types(node["type"]) == {"integer"}:
        _multiples(node, step, bounds, pointer)


def _multiples(node: dict[str, Any], step: int, bounds: dict[str, Any], pointer: str) -> None:
    """An integer multipleOf xgrammar would ignore (next to a bound, or above MAX_GRAMMAR_STEP) as the enum of the
    multiples within the bounds: exact up to MAX_MULTIPLES of them, else the first ones from the bound given (from 0
    without bounds), a narrowing."""
    lows = [v for k, v in bounds.items() if "inimum" in k and _is_number(v)]
    highs = [v for k, v in bounds.items() if "aximum" in k and _is_number(v)]
    low = math.ceil(max(lows) / step) if lows else None
    high = math.floor(min(highs) / step) if highs else None
    if low is None and high is None:
        low = 0
    if high is None or (low is not None and high - low >= MAX_MULTIPLES):
        assert low is not None
        high = low + MAX_MULTIPLES - 1
        narrowing.note("multipleOf", f"{pointer}/multipleOf", f"held to {MAX_MULTIPLES} multiples of {step} from "
                       f"{low * step} (the grammar ignores a multipleOf next to a bound or above {MAX_GRAMMAR_STEP})")
    elif low is None:
        low = high - MAX_MULTIPLES + 1
        narrowing.note("multipleOf", f"{pointer}/multipleOf", f"held to {MAX_MULTIPLES} multiples of {step} up to "
                       f"{high * step} (the grammar ignores a multipleOf next to a bound)")
    check = Draft202012Validator(bounds)
    values = [k * step for k in range(low, high + 1) if check.is_valid(k * step)]
    for key in ("multipleOf", *bounds):
        del node[key]
    if not values:
        raise Empty("multipleOf", f"{pointer}/multipleOf", "no multiple within the bounds")
    node["enum"] = values


_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "minContains",
           "maxContains")
NOTHING: dict[str, Any] = {"not": {}}  # the schema `false` as an object (the rewrite raises Empty on it)


def _boolean_forms(node: dict[str, Any]) -> None:
    """Boolean subschemas and integral counts written as the grammar reads them, in place (all exact): `true` is
    `{}`; a `false` anyOf/oneOf branch is dropped, a `false` prefix item ends the array, `propertyNames: false`
    allows no key, `not: false` is dropped, `if: true/false` selects then/else; `2.0` items is 2 items."""
    for key in _COUNTS:
        if isinstance(node.get(key), float) and node[key].is_integer():
            node[key] = int(node[key])
    for key in ("items", "contains", "then", "else", "unevaluatedItems", "unevaluatedProperties"):
        if node.get(key) is True:
            node[key] = {}
    if node.get("propertyNames") is True:
        del node["propertyNames"]
    elif node.get("propertyNames") is False:
        del node["propertyNames"]
        node["maxProperties"] = 0
    if node.get("not") is False:
        del node["not"]
    elif node.get("not") is True:
        node["not"] = {}
    if isinstance(node.get("if"), bool):
        chosen = node.pop("then" if node.pop("if") else "else", True)
        node.pop("then", None)
        node.pop("else", None)
        if chosen is not True:
            node.setdefault("allOf", []).append(NOTHING if chosen is False else chosen)
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and any(isinstance(b, bool) for b in node[key]):
            kept = [{} if b is True else b for b in node[key] if b is not False]
            node[key] = kept or [dict(NOTHING)]
    if isinstance(node.get("allOf"), list):
        node["allOf"] = [dict(NOTHING) if b is False else b for b in node["allOf"] if b is not True]
        if not node["allOf"]:
            del node["allOf"]
    if isinstance(node.get("prefixItems"), list):
        items = node["prefixItems"]
        if False in items:
            end = items.index(False)
            node["prefixItems"] = items[:end]
            node["maxItems"] = min(node.get("maxItems", end), end)
        node["prefixItems"] = [{} if b is True else b for b in node["prefixItems"]]
    for key in ("$defs", "definitions", "properties", "patternProperties"):
        if isinstance(node.get(key), dict):
            node[key] = {name: {} if sub is True else dict(NOTHING) if sub is False and key in DEFS else sub
                         for name, sub in node[key].items()}


def is_folder(node: Any) -> bool:
    """A dict under `$defs`/`definitions` that holds definitions instead of being one (no assertion keyword of its
    own, at least one schema inside)."""
    return isinstance(node, dict) and not _constraints(node) and any(
        isinstance(v, dict) and _constraints(v) for v in node.values())


MAX_CONTAINS_AT = 4  # contains: the first matching item is sought among this many leading items
MAX_UNIQUE_TUPLES = 64  # uniqueItems over finite item sets: the distinct arrays are listed up to this many


def _finite_values(sub: Any) -> list[Any] | None:
    """The values a schema that only lists values (const, enum, a boolean/null type) allows, else None."""
    if not isinstance(sub, dict) or not _constraints(sub) or _constraints(sub) - {"type", "enum", "const"}:
        return None
    types = _types(sub.get("type"))
    values = [sub["const"]] if "const" in sub else sub.get("enum")
    if values is None and types is not None and types <= {"boolean", "null"}:
        values = [v for v in (True, False, None) if _value_type_ok(v, types)]
    if not isinstance(values, list):
        return None
    return [v for v in values if types is None or _value_type_ok(v, types)]


def _same_key(value: Any) -> str:
    """A key equal for values JSON Schema counts as equal (1 and 1.0), different otherwise (1 and true)."""
    if _is_number(value):
        return f"n{_fraction(value)}"
    if isinstance(value, list):
        return "[" + ",".join(_same_key(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_same_key(v)}" for k, v in sorted(value.items())) + "}"
    return json.dumps(value)


def _unique_tuples(node: dict[str, Any]) -> bool:
    """`uniqueItems: true` on an array of bounded length whose every position lists finitely many values, as the
    allOf branch "one of the arrays of distinct values" (listed, up to MAX_UNIQUE_TUPLES of them; exact). Where only
    the prefix lists values, the arrays end with it (True: a narrowing)."""
    if node.get("uniqueItems") is not True or any(k in node for k in ("contains", "$ref")):
        return False
    prefix: list[Any] = node["prefixItems"] if isinstance(node.get("prefixItems"), list) else []
    items = node.get("items", True)
    bound = node.get("maxItems") if _is_number(node.get("maxItems")) else len(prefix) if items is False else None
    low = node.get("minItems", 0)
    cut = bound is None and bool(prefix) and _is_true(items) and all(_finite_values(p) is not None for p in prefix)
    if cut:
        bound = len(prefix)
    if bound is None or not _is_number(low):
        return False
    arrays: list[list[Any]] = []
    tuples: list[list[Any]] = [[]]  # the distinct arrays of the length reached
    for length in range(int(bound) + 1):
        arrays += tuples if length >= low else []
        if len(arrays) > MAX_UNIQUE_TUPLES:
            return False
        if length == bound:
            break
        values = _finite_values(prefix[length] if length < len(prefix) else items)
        if values is None:
            return False  # (an item there may take any of infinitely many values)
        tuples = [[*t, v] for t in tuples for v in values if _same_key(v) not in {_same_key(w) for w in t}]
        if not tuples:
            break
    others = sorted((_types(node.get("type")) or set(_ALL_TYPES)) - {"array"})
    branches: list[Any] = [{"type": others}] if others else []
    branches += [{"type": "array", "prefixItems": [{"const": v} for v in t], "minItems": len(t), "maxItems": len(t)}
                 for t in arrays]
    del node["uniqueItems"]
    node.setdefault("allOf", []).append({"anyOf": branches} if branches else dict(NOTHING))
    return cut


def _unique_items(node: dict[str, Any]) -> bool:
    """`uniqueItems: true` narrowed to `maxItems: 1` (zero or one item is always unique) where minItems allows;
    True when that narrowed (more than one item was allowed)."""
    if node.get("uniqueItems") is False:
        del node["uniqueItems"]
    elif node.get("uniqueItems") is True and node.get("minItems", 0) <= 1:
        del node["uniqueItems"]
        before = node.get("maxItems", 2)
        node["maxItems"] = min(node.get("maxItems", 1), 1)
        return before > 1
    return False


def _contains(node: dict[str, Any], negate: Callable[[Any], Any]) -> bool:
    """`contains` S with `minContains` n (1 unless given) and `maxContains` narrowed to "the first n items match S"
    and, under maxContains, "no later item matches S" (the later items held to `negate(S)`, a part of its
    complement, or left out where it has none): exact when no item may follow the n. minContains/maxContains
    without contains are ignored (exact). True when that narrowed; a shape it cannot write is left (refused)."""
    if "contains" not in node:
        for key in ("minContains", "maxContains"):
            node.pop(key, None)
        return False
    low, high = node.get("minContains", 1), node.get("maxContains")
    if not _count(low) or not (high is None or _count(high)):
        return False
    low = int(low)
    if (high is not None and high < low) or (node["contains"] is False and low > 0):
        return _no_arrays(node)
    if low == 0 and high is None:
        del node["contains"], node["minContains"]
        return False
    prefix, items = list(node.get("prefixItems") or []), node.get("items", True)
    cap = given = node.get("maxItems")
    if _is_number(cap) and cap < low:
        return False
    try:
        first = [_merge_sub(prefix[i] if i < len(prefix) else items, node["contains"], "/contains")
                 for i in range(low)]
        later: list[Any] = prefix[low:]
        if high is not None:
            neg = negate(node["contains"])
            if neg is None:
                later, cap = [], low
            else:
                later = [_merge_sub(p, neg, "/contains") for p in later]
                items = _merge_sub(items, neg, "/contains")
    except Unmergeable:
        return False  # left in place: reported as not enforced
    if any(sub is False for sub in first):
        return False
    for key in ("contains", "minContains", "maxContains"):
        node.pop(key, None)
    node["prefixItems"] = [*first, *later]
    if items is not True:
        node["items"] = items
    if cap is not None:
        node["maxItems"] = cap
    node["minItems"] = max(node.get("minItems", 0), low)
    node.setdefault("type", list(_ALL_TYPES))
    return given != low


def _no_arrays(node: dict[str, Any]) -> bool:
    """An array-matching nothing `contains` (false, maxContains < minContains): the other types only (exact)."""
    types = _types(node.get("type")) or set(_ALL_TYPES)
    if types <= {"array"}:
        return False  # (no value matches: refused)
    for key in ("contains", "minContains", "maxContains"):
        node.pop(key, None)
    node["type"] = sorted(types - {"array"})
    return False


def _count(value: Any) -> bool:
    return _is_number(value) and not isinstance(value, bool) and value >= 0 and float(value).is_integer()


def _children(node: dict[str, Any], pointer: str) -> list[tuple[Any, str]]:
    """The direct subschemas of `node` with their JSON pointers."""
    out = [(node[k], f"{pointer}/{k}") for k in ("additionalProperties", "propertyNames", "items",
                                                 "unevaluatedItems", "contains") if k in node]
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            out += [(sub, f"{pointer}/{key}/{pointer_token(name)}") for name, sub in node[key].items()]
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(node.get(key), list):
            out += [(sub, f"{pointer}/{key}/{i}") for i, sub in enumerate(node[key])]
    return out


def _has_negation(node: Any) -> bool:
    """A `not` left in the node, in its property / item schemas, or in every branch of its anyOf."""
    if not isinstance(node, dict):
        return False
    if "not" in node:
        return True
    if isinstance(node.get("anyOf"), list) and node["anyOf"] and all(_has_negation(b) for b in node["anyOf"]):
        return True
    subs = [*(node.get("properties") or {}).values(), node.get("items"), *(node.get("prefixItems") or [])]
    return any(_has_negation(sub) for sub in subs)


def _finish(node: Any, strict: bool, pointer: str = "") -> None:
    """Last narrowings: anyOf branches holding a `not` nothing resolved are dropped (while one branch is left), and
    a forbidden property (`false`) of a closed object is simply not declared; object keys as the grammar reads them
    (_pattern_keys, _required_declared)."""
    if not isinstance(node, dict):
        return
    if isinstance(node.get("required"), list):
        _required_declared(node)
    if strict:
        _objects_below_min(node, pointer)
    if isinstance(node.get("patternProperties"), dict) and node["patternProperties"]:
        _pattern_keys(node, strict, pointer)
    if isinstance(node.get("properties"), dict):
        _escaped_names(node, strict, pointer)
    if strict and "items" not in node and _is_number(node.get("minItems")) and node["minItems"] > len(
            node.get("prefixItems") or []):  # strict mode closes an array without items: any item, said explicitly
        node["items"] = {}
    if _is_number(node.get("maxItems")) and isinstance(node.get("prefixItems"), list) and len(
            node["prefixItems"]) > node["maxItems"]:  # no array reaches the later positions (xgrammar refuses them)
        node["prefixItems"] = node["prefixItems"][:max(0, int(node["maxItems"]))]
    if node.get("items") is False:  # no item may follow the prefix
        del node["items"]
        node["maxItems"] = min(node.get("maxItems", len(node.get("prefixItems", []))),
                               len(node.get("prefixItems", [])))
    props = node.get("properties")
    closed = node.get("additionalProperties", False if strict else True) is False
    if node.get("additionalProperties") is False and isinstance(node.get("propertyNames"), dict) and not node.get(
            "patternProperties"):  # (closed by its own keyword: strict mode does not close an object without names)
        _declared_names(node)
    if isinstance(props, dict) and closed:
        for name in [n for n, sub in props.items() if sub is False]:
            if not any(_matches(p, name) for p in node.get("patternProperties") or {}):
                del props[name]
    for child, child_pointer in _children(node, pointer):
        _finish(child, strict, child_pointer)
    if isinstance(node.get("anyOf"), list):  # (after the branches dropped their forbidden properties)
        kept = [b for b in node["anyOf"] if not _has_negation(b) and not _required_undeclared(b, strict)]
        if kept:
            if any(_has_negation(b) for b in node["anyOf"]):
                narrowing.note("anyOf", f"{pointer}/anyOf", "a branch holding a negation without a grammar form is "
                               "left out")
            node["anyOf"] = kept


def _pattern_keys(node: dict[str, Any], strict: bool, pointer: str) -> None:
    """patternProperties as xgrammar reads them, held to what JSON Schema allows. The grammar lets a key take any one
    pattern it matches (also a declared name), and an additional key any name when properties are declared (it drops
    additionalProperties next to patterns otherwise), so:
    - a declared property gets the schema of every pattern its name matches (exact);
    - a pattern's schema is merged with those of the patterns it may overlap and of the declared names it matches
      (a narrowing for the keys that match it alone);
    - additionalProperties goes (a narrowing where it allowed something)."""
    patterns = node["patternProperties"]
    props = node["properties"] if isinstance(node.get("properties"), dict) else {}
    for name, sub in list(props.items()):
        for pattern in patterns:
            if sub is not False and _matches(pattern, name):
                where = f"{pointer}/properties/{pointer_token(name)}"
                try:
                    sub = _merge_or_false(sub, patterns[pattern], where)
                except Unmergeable as e:
                    narrowing.note("patternProperties", where, f"the property is left out: {e.why}")
                    sub = False
        props[name] = sub
    merged = {}
    for pattern, sub in patterns.items():
        if not whole_string(pattern):
            narrowing.note("patternProperties", f"{pointer}/patternProperties/{pointer_token(pattern)}", "matched "
                           "against the whole key (JSON Schema searches it)")
        others = [patterns[q] for q in patterns if q != pattern and not _disjoint_patterns(pattern, q)]
        others += [props[name] for name in props if _matches(pattern, name)]
        out = sub
        for other in others:
            try:
                out = _merge_or_false(out, other, f"{pointer}/patternProperties/{pointer_token(pattern)}")
            except Unmergeable:
                out = False
        if _json(out) != _json(sub):
            narrowing.note("patternProperties", f"{pointer}/patternProperties/{pointer_token(pattern)}", "held to "
                           "the schemas of the other patterns and declared names it may match (the grammar lets a "
                           "key take any one of them)")
        merged[pattern] = out
    node["patternProperties"] = merged
    extra = node.get("additionalProperties", False if strict else True)
    if extra is not False:
        narrowing.note("additionalProperties", f"{pointer}/additionalProperties", "keys matching no pattern are not "
                       "generated next to patternProperties")
    node["additionalProperties"] = False


def _escaped_names(node: dict[str, Any], strict: bool, pointer: str) -> None:
    """A declared name that JSON writes with escapes (`foo"bar`, a newline) is not excluded from an open object's
    additional keys by the grammar (it excludes the raw characters only): additionalProperties is held to that
    property's schema too (a narrowing), or closed."""
    extra = node.get("additionalProperties", False if strict else True)
    escaped = [name for name in node["properties"] if json.dumps(name, ensure_ascii=False)[1:-1] != name]
    if extra is False or not escaped:
        return
    for name in escaped:
        try:
            extra = _merge_or_false(extra, node["properties"][name], f"{pointer}/additionalProperties")
        except Unmergeable:
            extra = False
    narrowing.note("additionalProperties", f"{pointer}/additionalProperties", "held to the schema of the declared "
                   "names JSON writes with escapes (the grammar can spell them as additional keys)")
    node["additionalProperties"] = extra


def _disjoint_patterns(a: str, b: str) -> bool:
    """True only when no string matches both (searched): both anchored at the start, with differing literal heads."""
    heads = []
    for pattern in (a, b):
        try:
            items = list(sre_parse.parse(pattern))
        except (re.error, RecursionError):
            return False
        if not items or items[0] != (sre_parse.AT, sre_parse.AT_BEGINNING):
            return False
        head = ""
        for op, arg in items[1:]:
            if op is not sre_parse.LITERAL:
                break
            head += chr(arg)
        heads.append(head)
    n = min(map(len, heads))
    return heads[0][:n] != heads[1][:n]


def _required_declared(node: dict[str, Any]) -> None:
    """A required name the object does not declare, where its keys are open to it (additionalProperties, or a
    pattern the name matches): declared with the schema that applies to it, since the grammar enforces required
    among declared properties only (exact). Strict mode closes an object to the names its schema gives, and a
    required one is given: without additionalProperties it is declared with any value (exact)."""
    props = node["properties"] if isinstance(node.get("properties"), dict) else {}
    extra = node.get("additionalProperties", True)
    patterns = node["patternProperties"] if isinstance(node.get("patternProperties"), dict) else {}
    for name in node["required"]:
        if not isinstance(name, str) or name in props:
            continue
        matching = [p for p in patterns if _matches(p, name)]
        if not matching and extra is False:
            continue  # (nothing can match: refused, or the anyOf branch is dropped)
        sub: Any = True if not matching else patterns[matching[0]]
        if not matching:
            sub = extra
        node.setdefault("properties", props)[name] = {} if sub is True else sub


def _objects_below_min(node: dict[str, Any], pointer: str) -> None:
    """Strict mode closes an object without additionalProperties or patterns to the names it declares; where
    minProperties asks for more, no object matches. An untyped node (or one with other types) keeps its other types,
    listed as a narrowing (objects left out); an object-only node is refused by name (schema_support)."""
    if ("additionalProperties" in node or node.get("patternProperties") or not _is_number(node.get("minProperties"))
            or any(k in node for k in ("const", "enum", "anyOf", "oneOf", "allOf", "$ref"))):
        return
    props = node["properties"] if isinstance(node.get("properties"), dict) else {}
    if node["minProperties"] <= sum(sub is not False for sub in props.values()):
        return
    types = _types(node.get("type"))
    others = sorted((types or set(_ALL_TYPES)) - {"object"})
    if not others or (types is not None and "object" not in types):
        return
    node["type"] = others
    least = node.pop("minProperties")
    narrowing.note("minProperties", f"{pointer}/minProperties", f"objects left out: strict mode closes them to the "
                   f"{len(props)} declared name(s), fewer than {least:g}")


def _declared_names(node: dict[str, Any]) -> None:
    """`propertyNames` of a closed object (declared names only) checked on those names with `jsonschema`: a name it
    rejects is forbidden, and the keyword goes (exact)."""
    try:
        check = Draft202012Validator(node["propertyNames"])
        rejected = [name for name in node.get("properties") or {} if not check.is_valid(name)]
    except Exception:  # noqa: BLE001 - a pattern Python cannot read, a $ref: left in place (and reported)
        return
    del node["propertyNames"]
    for name in rejected:
        node["properties"][name] = False


def _required_undeclared(node: Any, strict: bool) -> bool:
    """A closed object (strict mode closes those without additionalProperties) requiring a name it does not declare,
    or more properties than it declares (or an anyOf of such branches only): nothing can match it."""
    if not isinstance(node, dict) or node.get("patternProperties"):
        return False
    if isinstance(node.get("anyOf"), list) and node["anyOf"] and all(
            _required_undeclared(b, strict) for b in node["anyOf"]):
        return True
    closed = node.get("additionalProperties", False if strict else True) is False
    props = node["properties"] if isinstance(node.get("properties"), dict) else {}
    required = node["required"] if isinstance(node.get("required"), list) else []
    return closed and (any(name not in props for name in required) or (
        _is_number(node.get("minProperties")) and node["minProperties"] > len(props)))


def _matches(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True  # cannot tell: treated as matching, so the forbidden name stays (and is reported)


_REF_ALONE = re.compile(r"https?://json-schema\.org/draft-0[4-7]/schema#?$")
_KNOWN_DIALECT = re.compile(r"https?://json-schema\.org/(draft-0[4-7]/schema#?|draft/20(19-09|20-12)/schema)$")


def normalize(schema: dict[str, Any], strict: bool = True) -> tuple[dict[str, Any], list[Unmergeable]]:
    """The rewritten schema, and the parts that could not be rewritten (left unchanged in it)."""
    out, findings, _ = normalize_report(schema, strict)
    return out, findings


def normalize_report(schema: dict[str, Any], strict: bool = True
                     ) -> tuple[dict[str, Any], list[Unmergeable], list[narrowing.Narrowing]]:
    """normalize(), and where the rewritten schema accepts less than the original (one entry per keyword and
    pointer, in the order they were met)."""
    with narrowing.collect() as notes:
        dialect = schema.get("$schema")
        if isinstance(dialect, str) and not _KNOWN_DIALECT.match(dialect):
            narrowing.note("$schema", "/$schema", f"{dialect!r} is not a json-schema.org draft: every validation "
                           "keyword is enforced (its vocabularies are not read)")
        n = Normalizer(schema)
        try:
            out = n.run()
            n.relocate_refs(out)
        except RecursionError:
            raise TooComplex("the references nest too deeply") from None
        _finish(out, strict)
    unique: dict[tuple[str, str], narrowing.Narrowing] = {}
    for x in notes:
        unique.setdefault((x.keyword, x.pointer), x)
    return out, n.findings, list(unique.values())
