"""if/then/else, not, uniqueItems, contains, allOf object merges, unevaluatedProperties, anyOf next to oneOf:
each rewrite is checked against `jsonschema` on random candidate instances (valid and invalid ones): every instance
the rewritten schema accepts is valid under the original, and for the exact rewrites the converse holds too; what
stays refused names its keyword and JSON pointer."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for

from edgellm.errors import SchemaError
from edgellm.tokenizer import Tokenizer
from edgellm.bench.schema_corpus import load_corpus
from edgellm.structured.grammar import GrammarCache, compile_format
from edgellm.structured.xgrammar_core import core
from edgellm.response_format import ResponseFormat
from edgellm.structured.schema_normalize import normalize
from edgellm.structured import validate
from edgellm.structured.schema_support import check_schema, prepare_schema
from tests.support import grammar_walk
from tests.support.grammar_walk import cache, smol_tokenizer  # noqa: F401 (fixtures)
from tests.structured.test_structured_schema_gaps import random_logits

_STRINGS = ["", "a", "b", "x", "2024-02-29", "2023-02-29", "1899-12-31", "2024-13-01", "ab", "abcd", "a-b", "a--b",
            "0a-1b", "{{matrix", "Abc", "Bc", "bc", "c_B", "sync", "pip", "uv", "composite", "textarea", "[", "a(",
            "a b", "a..b", "a.b", "@{x", "x@y", "A_1"]
_SCALARS = [None, True, False, 0, 1, 2, 3, 5, -3, 2.5, *_STRINGS]


def _candidate(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A random instance shaped by `schema` (often valid, often not): declared names, enum values, nested shapes."""
    if depth > 5 or not isinstance(schema, dict) or rng.random() < 0.1:
        return rng.choice(_SCALARS)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key] and rng.random() < 0.6:
            return _candidate(rng.choice(schema[key]), rng, depth + 1)
    for key in ("then", "else", "if", "not", "contains"):
        if isinstance(schema.get(key), dict) and rng.random() < 0.3:
            return _candidate({**schema, **schema[key]} if key != "contains" else schema, rng, depth + 1)
    if "const" in schema and rng.random() < 0.7:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"] and rng.random() < 0.7:
        return rng.choice(schema["enum"])
    types = schema.get("type")
    kind = rng.choice(types) if isinstance(types, list) and types else types
    props = {**(schema.get("properties") or {})}
    for key in ("if", "then", "else", "not"):
        if isinstance(schema.get(key), dict):
            props.update(schema[key].get("properties") or {})
    if kind == "object" or (kind is None and props):
        names = [n for n in props if rng.random() < 0.6] + ([rng.choice(["zz", "Abcd", "x"])] if rng.random() < 0.2
                                                              else [])
        return {n: _candidate(props.get(n, {}), rng, depth + 1) for n in names}
    if kind == "array" or (kind is None and ("items" in schema or "contains" in schema)):
        item = schema.get("items", schema.get("contains", {}))
        return [_candidate(rng.choice([item, schema.get("contains", item)]), rng, depth + 1)
                for _ in range(rng.choice([0, 1, 1, 2, 3]))]
    pool = {"string": _STRINGS, "integer": [0, 1, 2, 3, 5, -1],
            "number": [0, 1.5, 3, -2.25], "boolean": [True, False], "null": [None]}.get(kind, _SCALARS)
    return rng.choice(pool)


def _compare(original: dict, rewritten: dict, exact: bool, n: int = 400) -> tuple[int, int]:
    """Check the rewrite on n candidates; returns (valid under the original, invalid under it)."""
    checker = Draft202012Validator.FORMAT_CHECKER
    orig = validator_for(original, default=Draft202012Validator)(original, format_checker=checker)
    new = validator_for(rewritten, default=Draft202012Validator)(rewritten, format_checker=checker)
    rng = random.Random(0)
    good = bad = 0
    for _ in range(n):
        value = _candidate(rng.choice([original, rewritten]), rng)
        ok = orig.is_valid(value)
        good, bad = good + ok, bad + (not ok)
        if new.is_valid(value):
            assert ok, f"the rewrite accepts {json.dumps(value)}, which the original rejects"
        elif exact:
            assert not ok, f"the exact rewrite rejects {json.dumps(value)}, which the original accepts"
    return good, bad


OBJ = {"type": "object", "additionalProperties": False}
# (name, schema, exact): schemas are written with closed objects (strict mode closes them anyway)
REWRITES = [
    ("if required then required else", {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                              "c": {"type": "integer"}},
                                        "if": {"required": ["a"]}, "then": {"required": ["b"]},
                                        "else": {"required": ["c"]}}, True),
    ("if const over an enum (github-issue-forms)", {**OBJ, "properties": {
        "type": {"enum": ["markdown", "textarea", "input"]}, "value": {}, "id": {"type": "string"}},
        "required": ["type"], "allOf": [
            {"if": {"properties": {"type": {"const": "markdown"}}},
             "then": {"properties": {"value": {"type": "string"}}, "required": ["value"]}},
            {"if": {"properties": {"type": {"const": "textarea"}}},
             "then": {"properties": {"id": {"type": "string"}}, "required": ["id"]}}]}, True),
    ("if boolean const, else anyOf required (woodpecker)", {**OBJ, "properties": {
        "detach": {"type": "boolean"}, "commands": {"type": "string"}, "image": {"type": "string"}},
        "if": {"properties": {"detach": {"const": True}}}, "then": {},
        "else": {"anyOf": [{"required": ["commands"]}, {"required": ["image"]}]}}, True),
    ("then not required (readthedocs)", {**OBJ, "properties": {"command": {"enum": ["sync", "pip"]},
                                                                "requirements": {"type": "string"},
                                                                "groups": {"type": "string"}},
                                         "allOf": [{"if": {"properties": {"command": {"const": "sync"}}},
                                                    "then": {"not": {"required": ["requirements"]}}},
                                                   {"if": {"properties": {"command": {"const": "pip"}}},
                                                    "then": {"not": {"required": ["groups"]}}}]}, True),
    ("if contains then maxItems 1 (readthedocs)", {
        "type": "array", "items": {**OBJ, "properties": {"method": {"enum": ["uv", "pip"]}}, "required": ["method"]},
        "if": {"contains": {"properties": {"method": {"const": "uv"}}, "required": ["method"]}},
        "then": {"minItems": 1, "maxItems": 1}}, True),
    ("if not required (gitlab)", {**OBJ, "properties": {"type": {"enum": ["string", "number"]},
                                                         "default": {"type": ["string", "number", "null"]}},
                                  "allOf": [{"if": {"properties": {"type": {"enum": ["number"]}}, "required": ["type"]},
                                             "then": {"properties": {"default": {"type": ["number", "null"]}}}},
                                            {"if": {"not": {"required": ["type"]}},
                                             "then": {"properties": {"default": {"type": ["string", "null"]}}}}]},
     True),
    ("if without required, not of values unresolved: narrowed", {**OBJ, "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "if": {"properties": {"a": {"const": 1}}},
        "then": {"required": ["b"]}}, False),
    ("not anyOf required", {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                            "not": {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}}, True),
    ("not of an enum value on an enum", {"enum": ["a", "b", "c"], "not": {"const": "b"}}, True),
    ("not of a type", {"type": ["string", "integer"], "not": {"type": "integer"}}, True),
    ("not of a minimum", {"type": "integer", "not": {"minimum": 3}}, True),
    ("uniqueItems narrowed to one item", {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True},
     False),
    ("contains narrowed to the first item", {"type": "array", "items": {"type": "integer"},
                                             "contains": {"minimum": 2}}, False),
    ("allOf: additionalProperties false against other properties", {"allOf": [
        {**OBJ, "properties": {"a": {"type": "integer"}, "b": {}}},
        {"type": "object", "properties": {"b": {"type": "string"}, "c": {"type": "integer"}}, "required": ["b"]}]},
     True),
    ("allOf: patternProperties and additionalProperties schemas", {"allOf": [
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
        {"type": "object", "properties": {"xa": {"minimum": 2}, "b": {}},
         "additionalProperties": {"type": "integer"}}]},
     True),
    ("unevaluatedProperties next to allOf", {"type": "object", "allOf": [
        {"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "string"}}}],
        "properties": {"c": {"type": "boolean"}}, "unevaluatedProperties": False}, True),
    ("unevaluatedProperties next to $ref", {"$defs": {"A": {"properties": {"a": {"type": "integer"}}}},
                                            "type": "object", "$ref": "#/$defs/A", "unevaluatedProperties": False},
     True),
    ("unevaluatedProperties next to anyOf: narrowed per branch", {
        "type": "object", "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                    {"properties": {"b": {"type": "integer"}}, "required": ["b"]}],
        "unevaluatedProperties": False}, False),
    ("anyOf next to oneOf", {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 0}],
                             "oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True),
    ("oneOf of required sets made exclusive (meltano)", {**OBJ, "properties": {
        "name": {"type": "string"}, "job": {"type": "string"}, "extractor": {"type": "string"}},
        "oneOf": [{"required": ["name", "job"]}, {"required": ["name", "extractor"]}]}, True),
    ("oneOf of closed objects made exclusive (woodpecker)", {"oneOf": [
        {**OBJ, "properties": {"env": {"type": "string"}}}, {**OBJ, "properties": {"file": {"type": "string"}}}]},
     False),
    ("oneOf of consts and a type", {"oneOf": [{"enum": ["a", "b"]}, {"type": "string", "maxLength": 0}]}, False),
    ("anyOf branch that no instance matches is dropped", {"$defs": {"S": {"type": "string"}}, "anyOf": [
        {"$ref": "#/$defs/S", "type": "integer"}, {"type": "integer", "minimum": 1, "maximum": 9}]}, True),
    ("pattern with maxLength: the repeat bounded (github-issue-forms)", {
        "type": "string", "maxLength": 5, "pattern": "^[a-z](-?[a-z])*$"}, False),
    ("pattern with minLength (mergify)", {"type": "string", "minLength": 2, "pattern": "^[A-Za-z0-9_-]+$"}, True),
    ("pattern whose lengths already fit", {"type": "string", "minLength": 2, "maxLength": 3,
                                           "pattern": "^[a-z]{2,3}$"}, True),
    ("format regex narrowed to literal strings", {"type": "string", "format": "regex"}, False),
    ("not of patterns: their first characters left out (dependabot)", {"type": "string", "minLength": 1, "allOf": [
        {"not": {"pattern": "[ ~^:?*\\[\\\\]"}}, {"not": {"pattern": "\\.\\."}}, {"not": {"pattern": "@\\{"}}]},
     False),
    ("not of patterns next to a pattern and lengths (buildkite)", {
        "type": "string", "maxLength": 6, "pattern": "^[a-zA-Z0-9_\\-:${}]+$",
        "not": {"anyOf": [{"pattern": "^[0-9a-f]{2}-[0-9a-f]{2}$"}, {"pattern": "\\{\\{matrix"}]}}, False),
    ("not of an anchored alternation (buildkite)", {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_]*$",
                                                   "not": {"pattern": "^(Ab|B)"}}, False),
    ("format date next to a pattern (citation-file-format)", {
        "type": "string", "format": "date", "pattern": "^[0-9]{4}-(0[1-9]|1[012])-(0[1-9]|[12][0-9]|3[01])$"}, False),
    ("an anyOf branch requiring an undeclared name of a closed object is dropped", {"anyOf": [
        {**OBJ, "properties": {"a": {"type": "integer"}}, "required": ["b"]},
        {**OBJ, "properties": {"a": {"type": "integer"}}}]}, True),
    ("a reference into a folder of definitions (meltano, travis)", {
        "$defs": {"folder": {"x": {"allOf": [{"type": "integer"}, {"minimum": 3, "maximum": 9}]}}},
        **OBJ, "properties": {"a": {"$ref": "#/$defs/folder/x"}}}, True),
    ("two references merged, one a reference to a reference", {"$defs": {
        "A": {"type": "integer", "minimum": 0}, "B": {"$ref": "#/$defs/C"}, "C": {"maximum": 5}},
        "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}, True),
    ("propertyNames of two branches", {"allOf": [
        {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "integer"}},
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}]}, True),
    ("dependentRequired, dependentSchemas, dependencies", {**OBJ, "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
        "dependentRequired": {"a": ["b"]}, "dependentSchemas": {"b": {"properties": {"c": {"minimum": 2}}}}}, True),
    ("draft-07 dependencies", {"$schema": "http://json-schema.org/draft-07/schema#", **OBJ, "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
        "dependencies": {"c": ["a"], "a": {"properties": {"b": {"minimum": 2}}}}}, True),
    ("optional property no instance matches is forbidden (bamboo-spec)", {**OBJ, "properties": {
        "r": {"type": "array", "anyOf": [{"type": "object"}]}, "n": {"type": "integer"}}}, True),
]


@pytest.mark.parametrize("name,schema,exact", REWRITES, ids=[r[0] for r in REWRITES])
def test_rewrites_agree_with_jsonschema(name: str, schema: dict, exact: bool) -> None:
    validator_for(schema, default=Draft202012Validator).check_schema(schema)
    assert check_schema(schema, strict=False) == ()
    rewritten, findings = normalize(schema, strict=False)
    assert findings == []
    good, bad = _compare(schema, rewritten, exact)
    assert good >= 10 and bad >= 10, (good, bad)  # the candidates exercised both sides


# (keyword, pointer, schema): no sound rewrite; refused by name
STILL_REFUSED = [
    ("not", "/not", {"type": "integer", "not": {"const": 3}}),
    ("not", "/not", {"type": "string", "not": {"pattern": "^[^a]"}}),
    ("if", "/if", {"type": "string", "if": {"pattern": "^a"}, "then": {"pattern": "^ab"}}),
    ("uniqueItems", "/uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True,
                                     "minItems": 2}),
    ("contains", "/contains", {"type": "array", "items": {"type": "integer"}, "contains": {"type": "string"},
                               "minContains": 2}),
    ("patternProperties", "/allOf/1", {"allOf": [
        {"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "additionalProperties": False},
        {"type": "object", "patternProperties": {"^b": {"type": "integer"}}}]}),
    ("oneOf", "/oneOf", {"oneOf": [{"type": "string"}, {"enum": ["a"]}]}),
    ("oneOf", "/$defs/folder/x/oneOf", {
        "$defs": {"folder": {"x": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/folder/x"}}}),
    ("anyOf", "/properties/r/anyOf", {"type": "object", "properties": {
        "r": {"type": "array", "anyOf": [{"type": "object"}]}}, "required": ["r"]}),
]


@pytest.mark.parametrize("keyword,pointer,schema", STILL_REFUSED, ids=[f"{r[0]}{r[1]}" for r in STILL_REFUSED])
def test_what_has_no_sound_rewrite_is_refused_by_name(keyword: str, pointer: str, schema: dict) -> None:
    with pytest.raises(SchemaError) as err:
        check_schema(schema)
    assert (err.value.keyword, err.value.pointer) == (keyword, pointer)
    assert f"{keyword} at {pointer}" in check_schema(schema, best_effort=True)


def test_a_forbidden_property_of_a_closed_object_is_left_out() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "additionalProperties": False, "not": {"required": ["b"]}}
    prepared, unenforced = prepare_schema(schema)
    assert unenforced == () and "b" not in prepared["properties"]


@pytest.mark.parametrize("entry,schema", load_corpus(), ids=[e["file"] for e, _ in load_corpus()])
def test_corpus_rewrites_only_narrow(entry: dict, schema: dict) -> None:
    """Every corpus schema that is accepted: instances of its rewrite validate under the original."""
    try:
        prepared, _ = prepare_schema(schema, strict=False)
    except SchemaError:
        pytest.skip("refused")
    if schema.get("$schema", "").startswith("http://json-schema.org/draft-0"):
        validator = validate.validator(schema, formats=False)  # (patterns with \p{Cc} read by the regex module)
    else:
        validator = validate.validator({**schema, "$schema": "https://json-schema.org/draft/2020-12/schema"},
                                       formats=False)
    rewritten = Draft202012Validator({**prepared, "$schema": "https://json-schema.org/draft/2020-12/schema"})
    rng = random.Random(1)
    for _ in range(150):
        value = _candidate(rng.choice([schema, prepared]), rng)
        if rewritten.is_valid(value):
            assert validator.is_valid(value), json.dumps(value)[:300]


@pytest.mark.parametrize("name,schema,exact", REWRITES, ids=[r[0] for r in REWRITES])
def test_grammar_walks_through_rewrites_only_finish_on_valid_instances(cache: GrammarCache,
                                                                      smol_tokenizer: Tokenizer, name: str,
                                                                      schema: dict, exact: bool) -> None:
    rf = ResponseFormat("json_schema", schema=schema, strict=False)
    validator = validate.validator(schema, formats=False)  # (reads \p{Cc} patterns too)
    finished = 0
    for seed in range(6):
        text, constraint = grammar_walk.drive(cache, smol_tokenizer, rf, random_logits(smol_tokenizer, seed),
                                              max_tokens=40, budget=True)
        if constraint.grammar_complete:
            finished += 1
            assert validator.is_valid(json.loads(text)), text
    assert finished >= 2, f"only {finished} of 6 random walks finished"


def test_a_raw_newline_in_a_pattern_class_compiles_and_is_enforced(cache: GrammarCache) -> None:
    compiled = compile_format(cache, ResponseFormat("json_schema", schema={"type": "string",
                                                                           "pattern": "^a(.|[\r\n])b$"}))
    # (xgrammar generates no newline from the class, escaped or raw: narrower than the pattern, never invalid)
    for text, ok in (('"axb"', True), ('"a\\nb"', False), ('"a\nb"', False), ('"ab"', False), ('"axxb"', False)):
        matcher = core().matcher(compiled.grammar)
        assert (matcher.accept_string(text) and matcher.is_completed()) is ok, text


def test_recent_dates_are_exactly_the_calendar_dates_of_1900_to_2099() -> None:
    import datetime
    import re

    from edgellm.structured.schema_strings import RECENT_DATE

    compiled = re.compile(f"^{RECENT_DATE}$")
    for year in (1899, 1900, 1996, 2000, 2023, 2024, 2099, 2100):
        for month in range(0, 14):
            for day in range(0, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    valid = 1900 <= datetime.date.fromisoformat(text).year <= 2099
                except ValueError:
                    valid = False
                assert bool(compiled.fullmatch(text)) is valid, text


def test_a_format_jsonschema_does_not_assert_next_to_a_pattern_is_an_annotation() -> None:
    from edgellm.structured.schema_strings import ASSERTED

    schema = {"type": "string", "format": "uri", "pattern": "^https://x\\.org/[0-9]+$"}
    if "uri" in ASSERTED:
        pytest.skip("rfc3987 is installed: jsonschema asserts uri")
    assert prepare_schema(schema) == ({"type": "string", "pattern": "^https://x\\.org/[0-9]+$"}, ())


def _generated_schemas():  # noqa: ANN202 - a Hypothesis strategy
    """Object schemas over three names mixing the rewritten keywords (if/then/else, not, allOf, oneOf, anyOf,
    dependentRequired, const/enum, required) — for the property "the rewrite only narrows"."""
    from hypothesis import strategies as st

    names = st.sampled_from(["a", "b", "c"])
    leaf = st.sampled_from([{"type": "integer"}, {"type": "string"}, {"const": 1}, {"enum": ["a", "b"]},
                            {"type": "boolean"}, {"type": "integer", "minimum": 2}, {"not": {"const": "a"}}])
    part = st.recursive(
        st.one_of(st.builds(lambda n, s: {"properties": {n: s}}, names, leaf),
                  st.builds(lambda ns: {"required": sorted(set(ns))}, st.lists(names, min_size=1, max_size=2))),
        lambda inner: st.one_of(
            st.builds(lambda x, y: {**x, **y}, inner, inner),
            st.builds(lambda x: {"not": x}, inner),
            st.builds(lambda i, t, e: {"if": i, "then": t, "else": e}, inner, inner, inner),
            st.builds(lambda bs: {"anyOf": bs}, st.lists(inner, min_size=1, max_size=3)),
            st.builds(lambda bs: {"oneOf": bs}, st.lists(inner, min_size=2, max_size=3)),
            st.builds(lambda bs: {"allOf": bs}, st.lists(inner, min_size=1, max_size=3)),
            st.builds(lambda n, ns: {"dependentRequired": {n: sorted(set(ns))}}, names, st.lists(names, max_size=2))),
        max_leaves=6)
    base = {"type": "object", "properties": {"a": {"type": ["integer", "string"]}, "b": {"type": "boolean"},
                                             "c": {"enum": ["a", "b", 1, 2]}}, "additionalProperties": False}
    return part.map(lambda p: {**base, "allOf": [p]})


def _generated_strings_and_arrays():  # noqa: ANN202 - a Hypothesis strategy
    """String schemas mixing pattern, lengths, not-pattern, formats; array schemas mixing items, prefixItems,
    contains, uniqueItems, bounds, not-contains, if-contains."""
    from hypothesis import strategies as st

    strings = st.sampled_from([
        {"pattern": "^[a-z]+$"}, {"pattern": "^(a|b)+$"}, {"minLength": 2}, {"maxLength": 3}, {"not": {"pattern": "b"}},
        {"not": {"pattern": "^a"}}, {"format": "regex"}, {"format": "date"}, {"const": "ab"},
        {"pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, {"enum": ["a", "ab", "abc"]}])
    items = st.sampled_from([{"type": "integer"}, {"enum": ["a", "b"]}, {"type": "string", "maxLength": 1},
                             {"minimum": 2}])
    arrays = st.one_of(
        st.builds(lambda i: {"items": i}, items), st.builds(lambda i: {"contains": i}, items),
        st.builds(lambda ps: {"prefixItems": ps}, st.lists(items, min_size=1, max_size=2)),
        st.sampled_from([{"uniqueItems": True}, {"minItems": 1}, {"maxItems": 2}]),
        st.builds(lambda i: {"not": {"contains": i}}, items),
        st.builds(lambda i: {"if": {"contains": i}, "then": {"maxItems": 1}}, items))
    return st.one_of(st.lists(strings, min_size=1, max_size=3).map(lambda ps: {"type": "string", "allOf": ps}),
                     st.lists(arrays, min_size=1, max_size=3).map(lambda ps: {"type": "array", "allOf": ps}))


@pytest.mark.parametrize("strategy", [_generated_schemas, _generated_strings_and_arrays])
def test_generated_rewrites_only_narrow(strategy: Any) -> None:
    """Random compositions: whatever is accepted, every candidate the rewrite accepts validates under the original."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings

    from tests.fuzz import examples

    seen = {"accepted": 0, "valid": 0}
    checker = Draft202012Validator.FORMAT_CHECKER

    @settings(max_examples=examples(300))
    @given(schema=strategy())
    def check(schema: dict) -> None:
        try:
            prepared, _ = prepare_schema(schema, strict=False)
        except SchemaError:
            return
        seen["accepted"] += 1
        original = Draft202012Validator(schema, format_checker=checker)
        rewritten = Draft202012Validator(prepared, format_checker=checker)
        rng = random.Random(0)
        for _ in range(60):
            value = _candidate(rng.choice([schema, prepared]), rng)
            if isinstance(value, list) and rng.random() < 0.5:
                value = [rng.choice([1, 2, 3, "a", "b", "ab"]) for _ in range(rng.randint(0, 3))]
            if rewritten.is_valid(value):
                seen["valid"] += 1
                assert original.is_valid(value), (json.dumps(schema), json.dumps(prepared), json.dumps(value))

    assert hypothesis
    check()
    assert seen["accepted"] >= examples(300) // 2 and seen["valid"] >= 5 * seen["accepted"], seen


def _keywords_left(node: Any, pointer: str = "") -> list[str]:
    """Every ignored keyword anywhere in the JSON (a walk of its own: every dict that is not a map of names, data
    values skipped), so that no part the rewrite missed can hide."""
    if isinstance(node, list):
        return [k for i, item in enumerate(node) for k in _keywords_left(item, f"{pointer}/{i}")]
    if not isinstance(node, dict):
        return []
    left = [f"{k} at {pointer}" for k in ("not", "if", "then", "else", "uniqueItems", "contains", "dependentRequired",
                                          "dependentSchemas", "dependencies", "unevaluatedProperties")
            if isinstance(node.get(k), (dict, bool)) and k in node]
    left += [f"allOf at {pointer}"] if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1 else []
    left += [f"oneOf at {pointer}"] if isinstance(node.get("oneOf"), list) else []  # xgrammar warns even on one branch
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            left += [k for name, sub in value.items() for k in _keywords_left(sub, f"{pointer}/{key}/{name}")]
        else:
            left += _keywords_left(value, f"{pointer}/{key}")
    return left


@pytest.mark.parametrize("entry,schema", load_corpus(), ids=[e["file"] for e, _ in load_corpus()])
def test_corpus_grammars_see_no_keyword_they_would_ignore(entry: dict, schema: dict) -> None:
    """What xgrammar compiles of an accepted schema (definitions and their folders included) holds none of the
    keywords it ignores or approximates."""
    try:
        prepared, _ = prepare_schema(schema)
    except SchemaError:
        pytest.skip("refused")
    assert _keywords_left(prepared) == []
