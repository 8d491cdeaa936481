"""References by name ($id, $anchor, URNs, $dynamicRef) followed inside the document, `uniqueItems` over finite item
sets, definitions that match nothing, and prefixes longer than maxItems: compiled over the suite's one-character
vocabulary and checked against `jsonschema` (what the grammar accepts is exactly what it validates)."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema.validators import validator_for

from edgellm.bench import schema_suite as suite
from edgellm.errors import SchemaError
from edgellm.response_format import ResponseFormat
from edgellm.structured.grammar import GrammarCache, compile_format
from tests.support.suite_grammar import cache, compile_lenient  # noqa: F401 (fixture)

_INSTANCES: list[Any] = [None, True, 0, 1, 2.5, "", "a", [], [1], ["a"], [1, "a"], {}, {"a": 1}, {"a": "x"},
                         {"a": [1]}, {"a": {"a": 1}}, {"b": 1}, {"a": 1, "b": "x"}]


def _verdicts(cache: GrammarCache, schema: dict[str, Any], instances: list[Any]) -> tuple[dict[str, bool], ...]:
    compiled = compile_lenient(cache, schema)
    check = validator_for(schema)(schema)
    return ({repr(v): suite._accepts(compiled, v) for v in instances},
            {repr(v): check.is_valid(v) for v in instances})


URN = "urn:uuid:deadbeef-1234-ffff-ffff-4321feebdaed"
BY_NAME = {
    "anchor": {"$ref": "#int", "$defs": {"A": {"$anchor": "int", "type": "integer"}}},
    "nested $id, relative": {
        "$id": "https://example.com/root.json", "type": "object", "properties": {"a": {"$ref": "b/item.json"}},
        "$defs": {"i": {"$id": "b/item.json", "$ref": "#/$defs/s", "$defs": {"s": {"type": "string"}}},
                  "s": {"type": "integer"}}},  # (#/$defs/s inside item.json is its own, not the root's)
    "anchor of a nested resource by absolute URI": {
        "$id": "https://example.com/root", "type": "object",
        "properties": {"a": {"$ref": "https://example.com/nested.json#arr"}},
        "$defs": {"n": {"$id": "nested.json", "$defs": {"x": {"$anchor": "arr", "type": "array"}}}}},
    "URN with a pointer": {"$id": URN, "type": "object", "properties": {"a": {"$ref": f"{URN}#/$defs/s"}},
                           "$defs": {"s": {"type": "string"}}},
    "draft-07 $id anchor": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                            "properties": {"a": {"$ref": "#num"}}, "definitions": {
                                "n": {"$id": "#num", "type": "integer"}}},
    "$dynamicRef bound at the root": {
        "$id": "https://example.com/root", "$ref": "list", "$defs": {
            "s": {"$dynamicAnchor": "items", "type": "string"},
            "list": {"$id": "list", "type": "array", "items": {"$dynamicRef": "#items"},
                     "$defs": {"any": {"$dynamicAnchor": "items"}}}}},
    "$dynamicRef to a plain anchor": {"type": "object", "properties": {"a": {"$dynamicRef": "#n"}},
                                      "$defs": {"n": {"$anchor": "n", "type": "integer"}}},
    "recursive through an anchor": {"$id": "https://example.com/tree", "type": "object", "properties": {
        "a": {"anyOf": [{"type": "integer"}, {"$ref": "#node"}]}}, "$anchor": "node"},
    "draft 2019-09 $recursiveRef": {"$schema": "https://json-schema.org/draft/2019-09/schema",
                                    "$recursiveAnchor": True, "type": "object", "properties": {
                                        "a": {"anyOf": [{"type": "integer"}, {"$recursiveRef": "#"}]}}},
    "$ref to true and false": {"type": "object", "properties": {"a": {"$ref": "#/$defs/yes"},
                                                                "b": {"$ref": "#/$defs/no"}},
                               "$defs": {"yes": True, "no": False}},
    "a definition no value matches": {"type": "object", "properties": {"b": {"$ref": "#/$defs/none"}},
                                      "$defs": {"none": {"allOf": [{"type": "integer"}, {"type": "string"}]}}},
}


@pytest.mark.parametrize("schema", BY_NAME.values(), ids=BY_NAME.keys())
def test_references_by_name_accept_exactly_what_jsonschema_validates(cache: GrammarCache, schema: dict) -> None:
    accepted, valid = _verdicts(cache, schema, _INSTANCES)
    assert accepted == valid


def test_a_dynamic_reference_that_depends_on_the_path_is_refused_by_name() -> None:
    schema = {"$id": "https://example.com/main", "type": "object", "properties": {
        "n": {"$ref": "numbers"}, "s": {"$ref": "strings"}}, "$defs": {
        "generic": {"$id": "generic", "items": {"$dynamicRef": "#t"}, "$defs": {"d": {"$dynamicAnchor": "t"}}},
        "numbers": {"$id": "numbers", "$ref": "generic", "$defs": {"t": {"$dynamicAnchor": "t", "type": "number"}}},
        "strings": {"$id": "strings", "$ref": "generic", "$defs": {"t": {"$dynamicAnchor": "t", "type": "string"}}}}}
    with pytest.raises(SchemaError) as err:
        compile_format(suite.suite_cache(), ResponseFormat("json_schema", schema=schema))
    assert err.value.keyword == "$dynamicRef" and err.value.pointer == "/$defs/generic/items/$dynamicRef"
    assert "depends on the path" in str(err.value)


def test_another_document_is_still_refused_by_name() -> None:
    schema = {"$id": "https://example.com/root", "type": "object", "properties": {"a": {"$ref": "other.json"}},
              "required": ["a"]}
    with pytest.raises(SchemaError) as err:
        compile_format(suite.suite_cache(), ResponseFormat("json_schema", schema=schema))
    assert err.value.keyword == "$ref" and "not fetched" in str(err.value)


_ARRAYS: list[Any] = [[], [1], [2], [1, 2], [2, 1], [1, 1], [1, 1.0], [1, 2, 3], [3, 2, 1], [1, 2, 1], [True],
                      [True, False], [False, True], [True, True], [1, True], [None, None], [None, True, False]]


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3, "uniqueItems": True},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "boolean"}], "items": False,
     "uniqueItems": True},
    {"items": {"type": ["boolean", "null"]}, "maxItems": 3, "minItems": 2, "uniqueItems": True},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "maxItems": 1},
    {"type": "array", "prefixItems": [{"const": 1}, {"enum": [1.0, 2]}], "items": False, "uniqueItems": True},
])
def test_unique_items_over_finite_sets_is_exact(cache: GrammarCache, schema: dict) -> None:
    accepted, valid = _verdicts(cache, schema, [*_ARRAYS, 5, "a"])
    assert accepted == valid
    assert compile_lenient(cache, schema).narrowed == ()


def test_unique_items_after_a_finite_prefix_is_a_named_narrowing(cache: GrammarCache) -> None:
    schema = {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "boolean"}], "uniqueItems": True}
    accepted, valid = _verdicts(cache, schema, _ARRAYS)
    assert [v for v, ok in accepted.items() if ok and not valid[v]] == []
    assert accepted["[True, False]"] and accepted["[False, True]"]
    assert [n for n in compile_lenient(cache, schema).narrowed if n.startswith("uniqueItems at /uniqueItems")]


@pytest.mark.parametrize("schema", [
    {"type": "array", "contains": {"type": "integer"}, "maxItems": 4},
    {"type": "array", "contains": {"type": "string"}, "maxContains": 1, "maxItems": 4},
    {"contains": {"type": "integer"}, "maxItems": 3},  # (any other type too)
])
def test_contains_finds_its_match_at_any_of_the_first_items(cache: GrammarCache, schema: dict) -> None:
    arrays = [[], [1], ["a"], ["a", 1], ["a", "a", 1], ["a", "a", "a", 1], ["a", 1, "a"], [1, "a", 1], ["a", "a"],
              [1, 1], ["a", "a", "a", "a", 1], 5, "a", {}]
    accepted, valid = _verdicts(cache, schema, arrays)
    assert accepted == valid
    assert compile_lenient(cache, schema).narrowed == ()


def test_contains_past_the_first_items_is_a_named_narrowing(cache: GrammarCache) -> None:
    schema = {"type": "array", "contains": {"type": "integer"}}
    arrays = [[1], ["a", "a", "a", 1], ["a", "a", "a", "a", 1], ["a"], []]
    accepted, valid = _verdicts(cache, schema, arrays)
    assert [v for v, ok in accepted.items() if ok and not valid[v]] == []
    assert accepted[repr(["a", "a", "a", 1])] and not accepted[repr(["a", "a", "a", "a", 1])]
    assert "contains at /contains: enforced where one of the first 4 items matches it" in compile_lenient(
        cache, schema).narrowed
