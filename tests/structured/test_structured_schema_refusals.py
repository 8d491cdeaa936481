"""Corpus schemas that used to be refused (issue 10): the rewrite no longer explodes on large real schemas, value-only
branches become one enum, values are filtered by the keywords next to them, and a `$ref` whose target already has
its sibling keywords stays a reference. Each rewrite is checked against `jsonschema` (tests/test_structured_schema_
keywords.py's random candidates), and the corpus schemas it unlocks are compiled without a model."""

from __future__ import annotations

import json
import re

import pytest

from edgellm.errors import SchemaError
from edgellm.tokenizer import Tokenizer
from edgellm.bench.schema_corpus import load_corpus
from edgellm.structured.grammar import GrammarCache, compile_format
from edgellm.structured.xgrammar_core import core
from edgellm.response_format import ResponseFormat
from edgellm.structured.schema_normalize import MAX_VISITS, Normalizer, normalize
from edgellm.structured.schema_strings import intersect_patterns, narrow_strings
from edgellm.structured.schema_support import check_schema, prepare_schema
from edgellm.structured.schema_unicode import translate
from edgellm.structured import validate
from edgellm.structured.validate import schema_errors
from tests.support.grammar_walk import cache, smol_tokenizer  # noqa: F401 (fixtures)
from tests.structured.test_structured_schema_keywords import _compare
from tests.structured.test_structured_schema_keywords import (
    test_grammar_walks_through_rewrites_only_finish_on_valid_instances as walks_finish_only_on_valid_instances,
)

_CORPUS = {entry["file"]: schema for entry, schema in load_corpus()}
OBJ = {"type": "object", "additionalProperties": False}
_DEFS = {"o": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}
# (name, schema, exact)
REWRITES = [
    ("anyOf of values next to a pattern is one filtered enum", {
        "anyOf": [{"enum": ["a", "b"]}, {"const": "ab"}, {"enum": ["x", 3]}], "pattern": "^a"}, True),
    ("oneOf of overlapping values keeps the values of one branch", {
        "oneOf": [{"enum": ["a", "b", None]}, {"enum": ["b", "x"]}, {"const": True}]}, True),
    ("enum next to string lengths", {"enum": ["a", "abcd", "x", "ab", 5], "minLength": 2}, True),
    ("const next to a number bound", {"type": "object", "properties": {"n": {"const": 5, "maximum": 3}},
                                      "additionalProperties": False}, True),
    ("$ref with the sibling its target has (azure-pipelines step)", {
        "$defs": _DEFS, "type": "object", "$ref": "#/$defs/o"}, True),
    ("a property whose schema is not {} is forbidden (bitbucket final step)", {
        **OBJ, "properties": {"a": {"not": {}}, "b": {"type": "integer"}}}, True),
    ("oneOf of required sets sharing a name (drone volumes)", {
        **OBJ, "properties": {"name": {"type": "string"}, "a": {"type": "integer"}, "b": {"type": "integer"},
                              "c": {"type": "integer"}},
        "oneOf": [{"required": ["name", "a"]}, {"required": ["name", "b"]}, {"required": ["name", "c"]}]}, False),
    ("oneOf of an anyOf of objects and a string (azure-pipelines root)", {
        "$defs": {"p": {"anyOf": [{**_DEFS["o"], "required": ["a"]}, {**_DEFS["o"], "required": ["b"]}]}},
        "oneOf": [{"$ref": "#/$defs/p"}, {"type": "string", "pattern": "^$"}]}, True),
]


@pytest.mark.parametrize("name,schema,exact", REWRITES, ids=[r[0] for r in REWRITES])
def test_rewrites_agree_with_jsonschema(name: str, schema: dict, exact: bool) -> None:
    assert check_schema(schema, strict=False) == ()
    rewritten, findings = normalize(schema, strict=False)
    assert findings == []
    good, bad = _compare(schema, rewritten, exact)
    assert good >= 10 and bad >= 10, (good, bad)


def test_oneof_branches_whose_patterns_overlap_exclude_each_others_separator() -> None:
    """bitbucket's import: `^[^:]+:[^:]+:[^:]+$` or `^[^@]+@[^@]+$`, where "a@b:c:d" matches both."""
    schema = {"oneOf": [
        {**OBJ, "properties": {"i": {"type": "string", "pattern": "^[^.]+\\.[^.]+$"}}, "required": ["i"]},
        {**OBJ, "properties": {"i": {"type": "string", "pattern": "^[^-]+-[^-]+$"}}, "required": ["i"]}]}
    rewritten, findings = normalize(schema, strict=False)
    assert findings == []
    _compare(schema, rewritten, exact=False)
    new, old = validate.validator(rewritten), validate.validator(schema)
    for text, ok in (("a.b", True), ("a-b", True), ("a.b-c", False), ("ab", False)):
        assert new.is_valid({"i": text}) is ok and old.is_valid({"i": text}) is ok, text


def test_an_optional_property_with_a_remote_ref_is_left_out() -> None:
    """drone's kubernetes `metadata` refers to kubernetes-definitions.json, which is not fetched."""
    schema = {**OBJ, "properties": {"m": {"type": "array", "items": {"$ref": "k8s.json#/definitions/x"}},
                                    "b": {"type": "integer"}}}
    prepared, unenforced = prepare_schema(schema)
    assert unenforced == () and set(prepared["properties"]) == {"b"}
    with pytest.raises(SchemaError) as err:  # required: nothing to narrow to
        check_schema({**schema, "required": ["m"]})
    assert err.value.keyword == "$ref"


@pytest.mark.parametrize("a,b,text,ok", [
    ("^https?://", "\\w\\.ya?ml$", "https://x/a.yml", True), ("^https?://", "\\w\\.ya?ml$", "a.yml", False),
    ("^[^:]*$", "\\w\\.ya?ml$", "dir/a.yaml", True), ("^[^:]*$", "\\w\\.ya?ml$", "c:/a.yml", False),
    ("^[^@]*$", "^[^:]+:[^:]+$", "a:b", True), ("^[^@]*$", "^[^:]+:[^:]+$", "a@x:b", False)])
def test_two_patterns_are_intersected_by_a_narrowing(a: str, b: str, text: str, ok: bool) -> None:
    """gitlab's include: `\\w\\.ya?ml$` and (`^https?://` or not `^\\w+://`)."""
    both = intersect_patterns(a, b)
    assert both is not None and (re.search(both, text) is not None) is ok
    if ok:
        assert re.search(a, text) and re.search(b, text)


@pytest.mark.parametrize("a,b", [("^https?://", "\\w\\.ya?ml$"), ("^[^:]*$", "\\w\\.ya?ml$"),
                                 ("^[^@]*$", "^[^:]+:[^:]+$"), ("^[^\\u002d]*$", "[a-z]+\\.(json|ya?ml)")])
def test_every_string_of_an_intersection_matches_both_patterns(a: str, b: str) -> None:
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    both = intersect_patterns(a, b)
    assert both is not None

    @hypothesis.settings(max_examples=300, deadline=None, database=None)
    @hypothesis.given(st.from_regex(both, fullmatch=True))
    def check(text: str) -> None:
        assert re.search(a, text) and re.search(b, text), text

    check()


def test_a_regex_format_next_to_a_pattern_keeps_its_safe_strings() -> None:
    node = {"type": "string", "format": "regex", "pattern": "^/.+/$"}  # gitlab's coverage
    narrow_strings(node)
    assert "format" not in node and re.fullmatch(node["pattern"], "/Code coverage: 12.5/")
    assert not re.fullmatch(node["pattern"], "/a(/") and not re.fullmatch(node["pattern"], "/a+/")


def test_value_branches_become_one_enum_and_the_pattern_goes() -> None:
    rewritten, _ = normalize({"anyOf": [{"enum": ["a", "b"]}, {"const": "ab"}], "pattern": "^a"})
    assert rewritten == {"enum": ["a", "ab"]}
    rewritten, _ = normalize({"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b", "x"]}]})
    assert rewritten == {"enum": ["a", "x"]}
    rewritten, _ = normalize({"oneOf": [{"enum": [1]}, {"enum": [1.0]}]})  # one value to JSON Schema: not counted
    assert "enum" not in rewritten


def test_a_ref_whose_target_refers_on_keeps_its_siblings_merged() -> None:
    schema = {"$defs": {"T": {"type": "object"}}, "$ref": "#", "minProperties": 1}  # the target is the node itself
    assert check_schema(schema, best_effort=True) != ()


@pytest.mark.parametrize("name", ["azure-pipelines.json", "bitbucket-pipelines.json", "drone-ci.json"])
def test_large_corpus_schemas_rewrite_within_the_visit_bound(name: str) -> None:
    """These visited more than 40000 subschemas (the same definitions rewritten again at every use)."""
    n = Normalizer(_CORPUS[name])
    n.run()
    assert n._visits < MAX_VISITS // 2


@pytest.mark.parametrize("name", ["azure-pipelines.json", "bitbucket-pipelines.json", "circle-ci.json",
                                  "drone-ci.json", "gitlab-ci.json"])
def test_once_refused_corpus_schemas_are_accepted(name: str) -> None:
    prepared, unenforced = prepare_schema(_CORPUS[name])
    assert unenforced == () and json.dumps(prepared)


def test_unicode_property_escapes_are_spelled_out_exactly() -> None:
    regex = pytest.importorskip("regex")
    for pattern in (r"^[^\s\p{Cc}]+$", r"^\p{Cc}$", r"^\P{Cc}$", r"^[\p{ASCII_Hex_Digit}]+$", r"^\p{ASCII}$"):
        translated = translate(pattern)
        for c in map(chr, range(0x3000)):
            assert (regex.search(pattern, c) is None) == (re.search(translated, c) is None), (pattern, hex(ord(c)))


@pytest.mark.parametrize("pattern", [r"^\p{L}+$", r"^[a\P{Cc}]$"])
def test_other_property_escapes_are_refused_by_name(pattern: str) -> None:
    with pytest.raises(SchemaError) as err:
        check_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}})
    assert (err.value.keyword, err.value.pointer) == ("pattern", "/properties/a/pattern")
    assert pattern.split("$")[0][-5:].rstrip("]+") in str(err.value)


def test_validation_reads_property_escapes() -> None:
    pytest.importorskip("regex")
    schema = {"type": "string", "pattern": r"^[^\s\p{Cc}]+$"}
    assert schema_errors("abc", schema) == [] and schema_errors("a\u0007", schema) != []


def test_a_ref_into_a_rewritten_place_points_to_a_copy_of_its_target() -> None:
    schema = {"type": "object", "additionalProperties": False, "properties": {
        "a": {"oneOf": [{"type": "string"}, {"type": "integer"}]}, "b": {"$ref": "#/properties/a/oneOf/1"}}}
    prepared, unenforced = prepare_schema(schema)
    assert unenforced == () and prepared["properties"]["b"]["$ref"].startswith("#/$defs/edgellm-ref-")
    assert prepared["$defs"][prepared["properties"]["b"]["$ref"].rsplit("/", 1)[1]] == {"type": "integer"}


_ORBS = {"type": "string", "pattern": r"^[a-z]@(dev:[^\s\p{Cc}]{1,3}|\d)$"}  # (bounded: random walks finish)


@pytest.mark.parametrize("name,schema", [(r[0], r[1]) for r in REWRITES] + [("\\p{Cc} in a class (circle-ci orbs)",
                                                                               _ORBS)])
def test_grammar_walks_only_finish_on_instances_of_the_original(cache: GrammarCache, smol_tokenizer: Tokenizer,
                                                                 name: str, schema: dict) -> None:
    walks_finish_only_on_valid_instances(cache, smol_tokenizer, name, schema, exact=False)


def test_the_grammar_keeps_control_characters_out_of_a_translated_class(cache: GrammarCache) -> None:
    compiled = compile_format(cache, ResponseFormat("json_schema", schema=_ORBS))
    for text, ok in (('"a@dev:x"', True), ('"a@dev:\\u0001"', False), ('"a@dev:\\u007f"', False),
                     ('"a@dev:\u00e9"', True), ('"a@dev:\u0085"', False), ('"a@3"', True)):
        matcher = core().matcher(compiled.grammar)
        assert (matcher.accept_string(text) and matcher.is_completed()) is ok, text
