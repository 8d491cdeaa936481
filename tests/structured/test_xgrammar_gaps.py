"""Canaries for the xgrammar gaps edgellm's schema rewrites work around (docs/structured-output.md, "xgrammar gaps").

Each case hands xgrammar the *original* construct, compiled as edgellm compiles a schema (compact separators,
`strict_mode` as the request's), and asserts the gap is still there: xgrammar accepts an instance `jsonschema`
rejects, rejects one `jsonschema` accepts, or fails to compile the construct. The day an upgrade fixes a gap its
case fails: the rewrite named in `where` can then be deleted (and the case with it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

VOCAB = [chr(i) for i in range(32, 127)] + ["\n", "\t"]  # one token per character: any text can be matched
DRAFT4 = "http://json-schema.org/draft-04/schema#"


@dataclass(frozen=True)
class Gap:
    name: str
    where: str  # the rewrite that exists because of it
    schema: dict[str, Any]
    instance: str  # JSON text
    gap: str  # "accepts" (an invalid instance), "rejects" (a valid one) or "raises" (the compile fails)
    strict: bool = True


GAPS = [
    Gap("a schema without type ignores string keywords", "schema_normalize: the type inferred from keywords",
        {"minLength": 3}, '"a"', "accepts"),
    Gap("typeless patternProperties accept anything", "schema_normalize: the type inferred from keywords",
        {"patternProperties": {"^x$": {"type": "integer"}}}, '{"x": "s"}', "accepts"),
    Gap("keywords next to anyOf are ignored", "schema_normalize: merged into each branch",
        {"type": "integer", "minimum": 5, "anyOf": [{"maximum": 100}, {"multipleOf": 2}]}, "1", "accepts"),
    Gap("keywords next to a one-branch allOf are ignored", "schema_normalize: allOf merged into one schema",
        {"type": "integer", "minimum": 5, "allOf": [{"maximum": 100}]}, "1", "accepts"),
    Gap("keywords next to $ref are ignored", "schema_normalize: merged with the referenced schema",
        {"$defs": {"N": {"type": "integer"}}, "type": "object",
         "properties": {"n": {"$ref": "#/$defs/N", "minimum": 3}}, "required": ["n"]}, '{"n": 1}', "accepts"),
    Gap("unevaluatedProperties is ignored", "schema_normalize: rewritten as additionalProperties",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False},
        '{"a": 1, "b": 2}', "accepts", strict=False),
    Gap("draft-04 boolean exclusiveMinimum fails to compile", "schema_normalize: the 2020-12 form",
        {"$schema": DRAFT4, "type": "integer", "minimum": 3, "exclusiveMinimum": True}, "3", "raises"),
    Gap("array-form items fail to compile", "schema_normalize: prefixItems",
        {"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, "[1]", "raises"),
    Gap("enum values of an excluded type are accepted", "schema_normalize: dropped",
        {"type": "string", "enum": ["a", 1]}, "1", "accepts"),
    Gap("if/then/else is ignored", "schema_normalize + schema_complement",
        {"type": "integer", "if": {"minimum": 10}, "then": {"maximum": 20}}, "30", "accepts"),
    Gap("not is ignored", "schema_normalize + schema_complement", {"type": "integer", "not": {"const": 3}}, "3",
        "accepts"),
    Gap("dependentRequired is ignored", "schema_normalize: branches by presence",
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
         "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "accepts"),
    Gap("uniqueItems is ignored", "schema_normalize", {"type": "array", "items": {"type": "integer"},
                                                       "uniqueItems": True}, "[1, 1]", "accepts"),
    Gap("contains is ignored", "schema_normalize", {"type": "array", "items": {"type": "integer"},
                                                    "contains": {"const": 5}}, "[1]", "accepts"),
    Gap("overlapping oneOf branches are read as anyOf", "schema_normalize: disjoint branches",
        {"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, "1", "accepts"),
    Gap("multipleOf next to a lone bound is ignored", "schema_normalize._multiples: the enum of the multiples",
        {"type": "integer", "multipleOf": 7, "minimum": 1}, "8", "accepts"),
    Gap("multipleOf above 1024 is ignored", "schema_normalize.MAX_GRAMMAR_STEP",
        {"type": "integer", "multipleOf": 1000000007}, "8", "accepts"),
    Gap("pattern with maxLength: the lengths are ignored", "schema_strings: one pattern implying both",
        {"type": "string", "pattern": "^a+$", "maxLength": 3}, '"aaaaa"', "accepts"),
    Gap("format with maxLength: the lengths are ignored", "schema_strings: one pattern implying both",
        {"type": "string", "format": "email", "maxLength": 5}, '"abcdef@x.com"', "accepts"),
    Gap("format date checks the syntax only", "schema_support.DATE_PATTERN (calendar dates)",
        {"type": "string", "format": "date"}, '"2024-02-31"', "accepts"),
    Gap("a const object is written without spaces", "schema_support._value_schema (member by member)",
        {"const": {"a": 1}}, '{"a": 1}', "rejects"),
    Gap("a member schema false fails to compile", "schema_support.NEVER (a string no text spells)",
        {"type": "object", "properties": {"a": False}}, "{}", "raises", strict=False),
    Gap("contains with minContains fails to compile", "schema_support._STRIP (best effort)",
        {"type": "array", "contains": {"type": "integer"}, "minContains": 2}, "[1, 2]", "raises"),
    Gap("a raw newline in a pattern's class fails to compile", "schema_support: control characters escaped",
        {"type": "string", "pattern": "^[\n]$"}, '"\\n"', "raises"),
    Gap("an optional group ending in a repeat matches without the group", "pattern_quirks.optional_groups_as_counts",
        {"type": "string", "pattern": "^aa(ba+)?$"}, '"aaa"', "accepts"),
    Gap("Unicode property escapes fail to compile", "schema_unicode: spelled out as classes",
        {"type": "string", "pattern": "^\\p{Cc}$"}, '"a"', "raises"),
]


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB), cache_enabled=False)


def _xgrammar_accepts(compiler: xgr.GrammarCompiler, gap: Gap) -> bool:
    """Does xgrammar, compiling the schema as edgellm does (structured/grammar.py), match the whole instance?"""
    compiled = compiler.compile_json_schema(json.dumps(gap.schema), strict_mode=gap.strict, any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(gap.instance) and matcher.is_completed()


def _valid(gap: Gap) -> bool:
    """The reference verdict: jsonschema, formats asserted."""
    validator = jsonschema.validators.validator_for(gap.schema)(gap.schema, format_checker=jsonschema.FormatChecker())
    return validator.is_valid(json.loads(gap.instance))


@pytest.mark.parametrize("gap", GAPS, ids=[g.name for g in GAPS])
def test_the_xgrammar_gap_is_still_there(compiler: xgr.GrammarCompiler, gap: Gap) -> None:
    if gap.gap == "raises":
        with pytest.raises(RuntimeError):
            _xgrammar_accepts(compiler, gap)
        return
    expected_valid = gap.gap == "rejects"
    assert _valid(gap) is expected_valid, "the case itself is wrong: jsonschema disagrees with its instance"
    assert _xgrammar_accepts(compiler, gap) is not expected_valid, \
        f"xgrammar no longer has this gap: the rewrite ({gap.where}) may be deleted"


def test_the_matcher_agrees_with_jsonschema_where_there_is_no_gap(compiler: xgr.GrammarCompiler) -> None:
    """The canaries' own check: where xgrammar enforces a keyword, it accepts the valid and rejects the invalid."""
    plain = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]}
    for text, valid in (('{"n": 3}', True), ('{"n": 1}', False), ('{"n": "x"}', False)):
        gap = Gap("plain", "-", plain, text, "accepts")
        assert _valid(gap) is valid and _xgrammar_accepts(compiler, gap) is valid
