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
- `enum` values of a type the schema excludes are accepted: they are dropped.
"""

from __future__ import annotations

import copy
import json
from typing import Any

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
_OPEN_OBJECT = ("additionalProperties", "patternProperties", "unevaluatedProperties", "propertyNames")
_TYPE_OF = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}


class Unmergeable(Exception):
    """A part of the schema that has no exact rewrite (keyword and JSON pointer, as SchemaError reports them)."""

    def __init__(self, keyword: str, pointer: str, why: str) -> None:
        super().__init__(why)
        self.keyword, self.pointer, self.why = keyword, pointer, why


class TooComplex(Exception):
    """Merging would visit more than MAX_VISITS subschemas (or nest too deep): refused as a whole."""


MAX_VISITS = 20000


class Empty(Unmergeable):
    """The intersection has no instance at all (e.g. different types): an anyOf branch that can be dropped."""


def _esc(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


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
    """The schema of the instances valid under both `a` and `b`, keyword by keyword; Unmergeable where inexact."""
    for x, y in ((a, b), (b, a)):
        limits = [k for k in _OPEN_OBJECT if k in x]
        if limits and set(y.get("properties", {})) - set(x.get("properties", {})):
            extra = sorted(set(y.get("properties", {})) - set(x.get("properties", {})))[0]
            raise Unmergeable(limits[0], pointer, f"property {extra!r} of one branch is limited by {limits[0]} of "
                              "another")
    out = copy.deepcopy(a)
    for key, value in b.items():
        if key not in ASSERTIONS and key not in DEFS:
            continue
        if key not in out or out[key] == value:
            out[key] = copy.deepcopy(value)
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
        elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
            for name, sub in value.items():
                here = f"{pointer}/properties/{_esc(name)}"
                mine = out[key].get(name)
                out[key][name] = (copy.deepcopy(sub) if mine is None
                                  else _merge(mine, sub, here) if isinstance(mine, dict) and isinstance(sub, dict)
                                  else _raise("properties", here, "boolean subschemas cannot be merged"))
        elif key in _LOWER and _is_number(value) and _is_number(out[key]):
            out[key] = max(out[key], value)
        elif key in _UPPER and _is_number(value) and _is_number(out[key]):
            out[key] = min(out[key], value)
        elif key == "enum" and isinstance(value, list) and isinstance(out[key], list):
            keep = [v for v in out[key] if _json(v) in {_json(w) for w in value}]
            if not keep:
                raise Empty("enum", pointer, "branches allow no common value")
            out[key] = keep
        elif key == "items" and isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _merge(out[key], value, f"{pointer}/items")
        else:
            raise Unmergeable(key, pointer, f"{key} differs between branches and has no exact intersection")
    return out


def _without_shared_types(branches: list[Any]) -> list[Any]:
    """oneOf branches narrowed by the type names another branch also lists (["string", "null"] and
    ["integer", "null"] become "string" and "integer": a null would match both, so it was never valid)."""
    lists = [_types(b.get("type")) if isinstance(b, dict) else None for b in branches]
    out = []
    for i, branch in enumerate(branches):
        mine = lists[i]
        shared = set().union(*(t for j, t in enumerate(lists) if j != i and t)) if mine else set()
        if not mine or not mine & shared:
            out.append(branch)
        elif mine - shared:
            rest = sorted(mine - shared)
            out.append({**branch, "type": rest[0] if len(rest) == 1 else rest})
    return out


def _raise(keyword: str, pointer: str, why: str) -> Any:
    raise Unmergeable(keyword, pointer, why)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _json(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


class Normalizer:
    """One pass over a schema; `findings` collects what could not be rewritten (left as it was)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.findings: list[Unmergeable] = []
        self._inlining: list[str] = []
        self._validator: Any = None
        self._visits = 0

    def run(self) -> dict[str, Any]:
        return self.node(copy.deepcopy(self.root), "")

    def _resolve(self, ref: str, pointer: str) -> dict[str, Any]:
        """A local `$ref` target, normalized, for merging (recursion cannot be merged)."""
        if not (ref == "#" or ref.startswith("#/")):
            raise Unmergeable("$ref", pointer, f"only local references (#/...) are supported, not {ref!r}")
        if ref in self._inlining:
            raise Unmergeable("$ref", pointer, f"recursive reference {ref} cannot be merged with other keywords")
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise Unmergeable("$ref", pointer, f"reference {ref} does not resolve")
            target = target[part]
        if not isinstance(target, dict):
            raise Unmergeable("$ref", pointer, f"reference {ref} is not an object schema")
        self._inlining.append(ref)
        try:
            return self.node(copy.deepcopy(target), ref[1:])
        finally:
            self._inlining.pop()

    def _branch(self, branch: Any, pointer: str) -> dict[str, Any]:
        if not isinstance(branch, dict):
            raise Unmergeable("allOf", pointer, "boolean subschemas cannot be merged")
        branch = self.node(branch, pointer)
        ref = branch.get("$ref")
        if isinstance(ref, str):
            rest = {k: v for k, v in branch.items() if k != "$ref"}
            return _merge(self._resolve(ref, pointer), rest, pointer)
        return branch

    def node(self, node: Any, pointer: str) -> Any:
        if not isinstance(node, dict):
            return node
        self._visits += 1
        if self._visits > MAX_VISITS:
            raise TooComplex(f"rewriting visits more than {MAX_VISITS} subschemas")
        self._draft04(node)
        try:
            node = self._applicators(node, pointer)
        except Unmergeable as e:
            self.findings.append(e)
        self._unevaluated(node, pointer)
        self._one_of(node)
        self._infer_type(node)
        self._filter_enum(node)
        for key in ("additionalProperties", "propertyNames", "items", "unevaluatedProperties", "unevaluatedItems",
                    "not", "if", "then", "else", "contains"):
            if isinstance(node.get(key), dict):
                node[key] = self.node(node[key], f"{pointer}/{key}")
        for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            if isinstance(node.get(key), dict):
                node[key] = {name: self.node(sub, f"{pointer}/{key}/{_esc(name)}") for name, sub in node[key].items()}
        for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            if isinstance(node.get(key), list):
                node[key] = [self.node(sub, f"{pointer}/{key}/{i}") for i, sub in enumerate(node[key])]
        return node

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

    def _applicators(self, node: dict[str, Any], pointer: str) -> dict[str, Any]:
        ref = node.get("$ref")
        if isinstance(ref, str) and _constraints(node) - {"$ref"}:
            rest = {k: v for k, v in node.items() if k != "$ref"}
            node = _merge(self._resolve(ref, f"{pointer}/$ref"), rest, pointer)
        if isinstance(node.get("allOf"), list):
            branches = node.pop("allOf")
            for i, branch in enumerate(branches):
                node = _merge(node, self._branch(branch, f"{pointer}/allOf/{i}"), f"{pointer}/allOf/{i}")
        for key in ("anyOf", "oneOf"):
            siblings = _constraints(node) - {key}
            if isinstance(node.get(key), list) and siblings:
                if len([k for k in _APPLICATORS if k in node]) > 1:
                    raise Unmergeable(key, f"{pointer}/{key}", "anyOf and oneOf in one schema are not merged")
                shared = {k: v for k, v in node.items() if k in siblings}
                merged = []
                for i, branch in enumerate(node[key]):
                    try:
                        merged.append(_merge(shared, self._branch(branch, f"{pointer}/{key}/{i}"),
                                             f"{pointer}/{key}/{i}"))
                    except Empty:
                        continue  # no instance matches this branch and its siblings: it adds nothing
                if not merged:
                    raise Unmergeable(key, f"{pointer}/{key}", "no branch is compatible with the keywords next to it")
                node = {k: v for k, v in node.items() if k not in siblings}
                node[key] = merged
        return node

    def _one_of(self, node: dict[str, Any]) -> None:
        """oneOf branches that provably exclude every other branch are kept (as anyOf, which the grammar enforces);
        the others are dropped — an instance of a kept branch matches exactly one branch, so this only narrows."""
        branches = node.get("oneOf")
        if not isinstance(branches, list) or len(branches) < 2:
            return
        branches = _without_shared_types(branches)
        seen = [self._seen(b) for b in branches]
        keep = [b for i, b in enumerate(branches)
                if all(j == i or self._disjoint(seen[i], seen[j], 3) for j in range(len(branches)))]
        if keep:
            del node["oneOf"]
            node["anyOf"] = keep

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
            if not isinstance(target, dict) or part not in target:
                raise Unmergeable("$ref", "", ref)
            target = target[part]
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
    def _infer_type(node: dict[str, Any]) -> None:
        if "type" in node or any(k in node for k in ("$ref", "const", "enum", *_APPLICATORS)):
            return
        kinds = [kind for kind, words in FAMILIES.items() if words & set(node)]
        if kinds:
            node["type"] = kinds[0] if len(kinds) == 1 else kinds

    @staticmethod
    def _filter_enum(node: dict[str, Any]) -> None:
        types = _types(node.get("type"))
        if types and isinstance(node.get("enum"), list):
            node["enum"] = [v for v in node["enum"] if _value_type_ok(v, types)]


def normalize(schema: dict[str, Any]) -> tuple[dict[str, Any], list[Unmergeable]]:
    """The rewritten schema, and the parts that could not be rewritten (left unchanged in it)."""
    n = Normalizer(schema)
    try:
        out = n.run()
    except RecursionError:
        raise TooComplex("the references nest too deeply") from None
    return out, n.findings
