"""References by name resolved inside the document: every `$ref` / `$dynamicRef` / `$recursiveRef` that names a
place in the schema itself becomes a `#/json/pointer` reference to it, which the rest of the rewrite follows.

Resolved: `$id` (relative and absolute URIs against the base in scope, nested resources, URNs), `$anchor`,
draft-07 `$id: "#name"` anchors, JSON-pointer fragments of any resource (percent-decoded), and a `$dynamicRef` /
`$recursiveRef` where its target is static: the initial target when it carries no matching dynamic anchor; else
the anchor in the document's root resource (always the outermost of the dynamic scope), or the only resource that
evaluation from the root can reach defining that anchor. One that depends on the evaluation path is refused by
name. References to other documents are left as written (not fetched: reported where they are checked).
Identifiers and anchors go once resolved; a reference to a boolean schema is inlined (`true`: dropped, `false`:
the node matches nothing).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from edgellm.errors import pointer_token
from edgellm.structured.schema_normalize import is_folder

_SINGLE = ("additionalProperties", "propertyNames", "items", "additionalItems", "unevaluatedItems",
           "unevaluatedProperties", "contains", "not", "if", "then", "else")
_MAPS = ("properties", "patternProperties", "dependentSchemas", "dependencies", "$defs", "definitions")
_LISTS = ("prefixItems", "items", "anyOf", "oneOf", "allOf")
_DEFS = ("$defs", "definitions")
_REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
_NAMING = ("$id", "$anchor", "$dynamicAnchor", "$recursiveAnchor")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_ANCHORS = {2019: ("$anchor",), 2020: ("$anchor", "$dynamicAnchor")}  # (draft-07 names anchors with $id "#name")
_RECURSIVE = "#"  # the name $recursiveAnchor: true stands for (draft 2019-09 has one dynamic anchor per resource)
NOTHING: dict[str, Any] = {"not": {}}


@dataclass(frozen=True)
class Unresolved:
    """A dynamic reference whose target depends on the path evaluation took (keyword and JSON pointer)."""

    keyword: str
    pointer: str
    why: str


def _draft(schema: dict[str, Any]) -> int:
    """2020 for draft 2020-12 (the default), 2019 for 2019-09, 7 for draft-07 and earlier."""
    dialect = schema.get("$schema")
    if isinstance(dialect, str) and "2019-09" in dialect:
        return 2019
    if isinstance(dialect, str) and re.search(r"draft-0[3-7]/", dialect):
        return 7
    return 2020


def _join(base: str, ref: str) -> str | None:
    """`ref` resolved against `base` (None where a relative path meets a base that has no paths, e.g. a URN)."""
    if _SCHEME.match(ref):
        return ref
    if ref.startswith("#"):
        return base.split("#", 1)[0] + ref
    if base and not urlsplit(base).netloc and not base.startswith(("/", "file:")) and _SCHEME.match(base):
        return None  # urn:..., tag:... (no hierarchy to resolve a path against)
    return urljoin(base, ref)


def _split(uri: str) -> tuple[str, str]:
    head, _, fragment = uri.partition("#")
    return head, unquote(fragment)


def subschemas(node: dict[str, Any], pointer: str) -> Iterator[tuple[Any, str, bool]]:
    """The subschemas of `node` where JSON Schema reads keywords (never inside enum/const/unknown keywords), with
    their pointers and whether evaluation enters them from `node` (definitions are entered by reference only)."""
    for key in _SINGLE:
        if isinstance(node.get(key), (dict, bool)):
            yield node[key], f"{pointer}/{key}", True
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            yield from _entries(node[key], f"{pointer}/{pointer_token(key)}", key in _DEFS)
    for key in _LISTS:
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield child, f"{pointer}/{key}/{i}", True


def _entries(mapping: dict[str, Any], pointer: str, definitions: bool) -> Iterator[tuple[Any, str, bool]]:
    for name, child in mapping.items():
        where = f"{pointer}/{pointer_token(name)}"
        if definitions and is_folder(child) and not any(k in child for k in (*_REF_KEYWORDS, *_NAMING, *_DEFS)):
            yield from _entries(child, where, True)  # a folder of definitions (`#/$defs/plugins/extractor`)
        elif isinstance(child, (dict, bool)):
            yield child, where, not definitions


class _Index:
    """Where each resource, anchor and dynamic anchor of a document is, and the base URI of each schema."""

    def __init__(self, doc: dict[str, Any], draft: int) -> None:
        self.doc, self.draft = doc, draft
        self.resources: dict[str, str] = {}  # absolute URI -> pointer
        self.anchors: dict[str, str] = {}  # URI#name -> pointer
        self.dynamic: dict[str, list[str]] = {}  # dynamic anchor name -> pointers of the schemas defining it
        self.base: dict[str, str] = {}  # pointer -> base URI in scope there
        self.resource_of: dict[str, str] = {}  # pointer -> pointer of its resource's root
        self.nodes: dict[str, dict[str, Any]] = {}
        self.entered_from: dict[str, list[str]] = {}  # pointer -> subschemas evaluation enters from it
        self._scan(doc, "", "", "")

    def _scan(self, node: Any, pointer: str, base: str, resource: str) -> None:
        if not isinstance(node, dict):
            return
        ident = node.get("$id")
        if isinstance(ident, str) and not (self.draft == 7 and "$ref" in node):  # (draft-07 ignores $ref's siblings)
            joined = _join(base, ident)
            if joined is not None:
                head, fragment = _split(joined)
                if head != base.split("#", 1)[0] or not pointer:
                    base, resource = head, pointer
                    self.resources.setdefault(head, pointer)
                if fragment and not fragment.startswith("/"):
                    self.anchors.setdefault(f"{head}#{fragment}", pointer)
        if not pointer:
            self.resources.setdefault(base, "")
        for key in _ANCHORS.get(self.draft, ()):
            if isinstance(node.get(key), str):
                self.anchors.setdefault(f"{base.split('#', 1)[0]}#{node[key]}", pointer)
        if isinstance(node.get("$dynamicAnchor"), str) and self.draft == 2020:
            self.dynamic.setdefault(node["$dynamicAnchor"], []).append(pointer)
        if node.get("$recursiveAnchor") is True and self.draft == 2019 and resource == pointer:
            self.dynamic.setdefault(_RECURSIVE, []).append(pointer)
        self.base[pointer], self.resource_of[pointer], self.nodes[pointer] = base, resource, node
        self.entered_from[pointer] = []
        for child, where, entered in subschemas(node, pointer):
            if entered:
                self.entered_from[pointer].append(where)
            self._scan(child, where, base, resource)

    def locate(self, pointer: str) -> tuple[Any, str] | None:
        """The value at a JSON pointer, and the pointer as the rewrite's 2020-12 forms spell it (draft-07's
        array `items` is `prefixItems`, its `additionalItems` is `items`); None if nothing is there."""
        node: Any = self.doc
        out = ""
        for raw in pointer.split("/")[1:] if pointer else []:
            token = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
                out += f"/{token}"
            elif isinstance(node, dict) and token in node:
                spelled = token
                if token == "items" and isinstance(node["items"], list):
                    spelled = "prefixItems"
                elif token == "additionalItems" and isinstance(node.get("items"), list):
                    spelled = "items"
                node = node[token]
                out += f"/{pointer_token(spelled)}"
            else:
                return None
        return node, out

    def target(self, ref: str, at: str) -> str | None:
        """The pointer `ref` (written at the schema `at`) names in this document, or None."""
        joined = _join(self.base[at], ref)
        if joined is None:
            return None
        head, fragment = _split(joined)
        if not fragment or fragment.startswith("/"):
            root = self.resources.get(head)
            return None if root is None else root + fragment
        return self.anchors.get(f"{head}#{fragment}")

    def entered(self) -> set[str]:
        """The resources evaluation from the root may enter (the only ones a dynamic scope can hold): by descent,
        by reference, and by a dynamic reference to an anchor of a resource already entered (a fixed point)."""
        resources = {""}
        while True:
            seen: set[str] = set()
            todo = [""]
            while todo:
                at = todo.pop()
                if at in seen or at not in self.nodes:
                    continue
                seen.add(at)
                node = self.nodes[at]
                todo += self.entered_from[at]
                for key in _REF_KEYWORDS:
                    if isinstance(node.get(key), str):
                        found = self.target(node[key], at)
                        todo += [found] if found is not None else []
                        name = _RECURSIVE if key == "$recursiveRef" else _split(node[key])[1]
                        todo += [p for p in self.dynamic.get(name, []) if key != "$ref" and self.resource_of[p]
                                 in resources]
            grown = resources | {self.resource_of[p] for p in seen}
            if grown == resources:
                return resources
            resources = grown


def resolve_refs(schema: dict[str, Any]) -> tuple[dict[str, Any], list[Unresolved]]:
    """A copy of `schema` with every reference into itself written as a `#/...` pointer (identifiers and anchors
    removed), and the dynamic references whose target depends on the evaluation path (left out of the copy)."""
    doc = json.loads(json.dumps(schema))
    index = _Index(doc, _draft(doc))
    entered = index.entered()
    unresolved: list[Unresolved] = []
    rewrites: list[tuple[str, list[str], bool | None]] = []  # pointer, its references as pointers, boolean target
    for at, node in index.nodes.items():
        refs: list[str] = []
        boolean: bool | None = None
        for key in _REF_KEYWORDS:
            ref = node.get(key)
            if not isinstance(ref, str) or (key, index.draft) in (("$dynamicRef", 2019), ("$dynamicRef", 7),
                                                                  ("$recursiveRef", 2020), ("$recursiveRef", 7)):
                continue  # (not a keyword of this draft: ignored, as validators do)
            found = index.target(ref, at)
            if found is not None and key != "$ref":
                found, why = _dynamic(index, key, ref, found, entered)
                if found is None:
                    unresolved.append(Unresolved(key, f"{at}/{key}", why))
                    continue
            located = index.locate(found) if found is not None else None
            if located is None:
                if key == "$ref":
                    refs.append(ref)  # (another document, or nothing: reported where it is checked)
                else:
                    unresolved.append(Unresolved(key, f"{at}/{key}", f"{ref!r} names nothing in this document"))
                continue
            value, spelled = located
            if isinstance(value, bool):
                boolean = value if boolean is None else boolean and value
            else:
                refs.append("#" + spelled)
        rewrites.append((at, refs, boolean))
    for at, refs, boolean in rewrites:
        node = index.nodes[at]
        for key in (*_REF_KEYWORDS, *_NAMING):
            node.pop(key, None)
        if boolean is False:
            node.clear()
            node.update(NOTHING)
            continue
        if refs:
            node["$ref"] = refs[0]
            if len(refs) > 1:
                node["allOf"] = [*node.get("allOf", []), *({"$ref": r} for r in refs[1:])]
    for node in index.nodes.values():  # a `false` definition is only ever reached through a reference: inlined
        for key in _DEFS:
            if isinstance(node.get(key), dict):
                node[key] = {name: sub for name, sub in node[key].items() if sub is not False}
    return doc, unresolved


def _dynamic(index: _Index, key: str, ref: str, initial: str, entered: set[str]) -> tuple[str | None, str]:
    """The static target of a dynamic reference whose initial target is `initial`, or None and why not (`entered`:
    the resources evaluation from the root may enter, the only ones that can be in its dynamic scope)."""
    located = index.locate(initial)
    target = located[0] if located is not None else None
    if key == "$dynamicRef":
        name = _split(ref)[1]
        bookended = isinstance(target, dict) and target.get("$dynamicAnchor") == name and not name.startswith("/")
    else:
        name = _RECURSIVE
        bookended = isinstance(target, dict) and target.get("$recursiveAnchor") is True
    if not bookended:
        return initial, ""
    defining = [p for p in index.dynamic.get(name, []) if index.resource_of[p] in entered or p == initial]
    at_root = [p for p in defining if index.resource_of[p] == ""]
    if at_root:
        return at_root[0], ""
    if {index.resource_of[p] for p in defining} <= {index.resource_of[initial]}:
        return initial, ""
    label = "$recursiveAnchor" if key == "$recursiveRef" else f"$dynamicAnchor {name!r}"
    return None, (f"its target depends on the path evaluation takes ({len({index.resource_of[p] for p in defining})}"
                  f" resources define {label}, none the root)")
