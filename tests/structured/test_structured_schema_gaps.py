"""Schema shapes xgrammar ignores on its own: each is either enforced exactly (random walks through the grammar
only ever finish on instances that validate with `jsonschema`) or refused by name with its JSON pointer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgellm.errors import SchemaError
from edgellm.tokenizer import Tokenizer
from edgellm.structured.grammar import GrammarCache
from edgellm.structured.loop_guard import token_texts
from edgellm.response_format import ResponseFormat
from edgellm.structured.schema_support import check_schema
from edgellm.structured.validate import schema_errors
from tests.support import grammar_walk
from tests.support.grammar_walk import VOCAB, cache, smol_tokenizer  # noqa: F401 (fixtures)

DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"
# (name, schema, strict) -- each was let through unenforced before (issue 10), now enforced
ENFORCED = [
    ("two multipleOf in allOf: their least common multiple", {"allOf": [
        {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 100}, {"type": "integer", "multipleOf": 3}]}, True),
    ("multipleOf next to bounds (xgrammar ignores it there): the multiples", {"type": "integer", "multipleOf": 7,
                                                                           "minimum": -20, "maximum": 60}, True),
    ("typeless patternProperties (the issue's schema)",
     {"patternProperties": {"[A-Za-z0-9-_.:]{1,255}": {"type": "string", "format": "uri"}}}, True),
    ("patternProperties, plain JSON Schema", {"type": "object", "patternProperties": {"^x-": {"type": "integer"}},
                                              "properties": {"name": {"type": "string"}}}, False),
    ("typeless string keywords", {"minLength": 2, "maxLength": 4}, True),
    ("typeless object keywords", {"properties": {"a": {"type": "integer"}}, "required": ["a"],
                                  "minProperties": 1}, True),
    ("typeless mixed keywords", {"minLength": 3, "minimum": 10}, True),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"},
                       "additionalProperties": {"type": "integer"}}, False),
    ("properties next to anyOf", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {
        "type": "string"}, "c": {"type": "boolean"}}, "required": ["a"], "anyOf": [{"required": ["b"]},
                                                                                   {"required": ["c"]}]}, True),
    ("properties next to a one-branch allOf", {"type": "object", "properties": {"a": {"type": "integer"}},
                                               "required": ["a"], "allOf": [{"properties": {"b": {
                                                   "type": "integer", "minimum": 5}}, "required": ["b"]}]}, True),
    ("allOf of $refs", {"definitions": {"base": {"type": "object", "properties": {"id": {"type": "integer"}},
                                                 "required": ["id"]},
                                        "named": {"properties": {"name": {"type": "string", "maxLength": 5}},
                                                  "required": ["name"]}},
                        "allOf": [{"$ref": "#/definitions/base"}, {"$ref": "#/definitions/named"}]}, True),
    ("keywords next to $ref", {"$defs": {"N": {"type": "integer"}}, "type": "object", "properties": {
        "n": {"$ref": "#/$defs/N", "minimum": 3, "maximum": 9}}, "required": ["n"]}, True),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": {"type": "integer"}},
                               "unevaluatedProperties": False}, False),
    ("unevaluatedItems", {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, False),
    ("draft-04 exclusiveMinimum", {"$schema": DRAFT4, "type": "integer", "minimum": 3, "exclusiveMinimum": True,
                                   "maximum": 6, "exclusiveMaximum": True}, True),
    ("draft-07 tuple items", {"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}, {
        "type": "string"}], "additionalItems": False}, True),
    ("draft-04 id and definitions", {"$schema": DRAFT4, "id": "http://example.com/s.json", "definitions": {
        "p": {"type": "string", "enum": ["x", "y"]}}, "type": "object", "properties": {
        "p": {"$ref": "#/definitions/p"}}, "required": ["p"]}, True),
    ("enum of mixed types under a type", {"type": "string", "enum": ["a", 1, "b", None]}, True),
    ("minContains without contains", {"type": "array", "items": {"type": "integer"}, "minContains": 2}, True),
]
# (keyword, pointer, schema) -- refused by name
REFUSED = [
    ("if", "/if", {"type": "string", "if": {"pattern": "^a"}, "then": {"pattern": "^ab"}}),
    ("not", "/not", {"type": "integer", "not": {"const": 3}}),
    ("contains", "/contains", {"type": "array", "items": {"type": "integer"}, "contains": {"type": "string"}}),
    ("$ref", "/properties/a/$ref", {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}},
                                    "required": ["a"]}),  # (optional: left out instead)
    ("patternProperties", "/allOf/1", {"allOf": [
        {"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "additionalProperties": False},
        {"type": "object", "patternProperties": {"^b": {"type": "integer"}}}]}),
    ("type", "/allOf/1", {"allOf": [{"type": "integer"}, {"type": "string"}]}),
    ("$ref", "/$ref", {"$defs": {"T": {"type": "object", "properties": {"kids": {"type": "array",
                                                                                  "items": {"$ref": "#"}}}}},
                       "$ref": "#", "minProperties": 1}),
]


def random_logits(tokenizer: Tokenizer, seed: int):
    """Random logits, with a lean towards short tokens and closing characters so that walks finish."""
    table = token_texts(tokenizer, VOCAB)
    short = torch.tensor([len(t) <= 2 for t in table.texts] + [False] * (VOCAB - len(table.texts)))
    generator = torch.Generator().manual_seed(seed)

    def logits(_text: str) -> torch.Tensor:
        out = torch.randn(VOCAB, generator=generator) * 2.0
        out[short] += 2.0
        for kind in ("string", "number", "array"):
            out[table.closers[kind]] += 1.5
        return out

    return logits


@pytest.mark.parametrize("name,schema,strict", ENFORCED, ids=[e[0] for e in ENFORCED])
def test_enforced_shapes_only_produce_valid_instances(cache: GrammarCache, smol_tokenizer: Tokenizer, name: str,
                                                      schema: dict, strict: bool) -> None:
    assert check_schema(schema, strict=strict) == ()
    rf = ResponseFormat("json_schema", schema=schema, strict=strict)
    finished = 0
    for seed in range(6):  # the budget finish closes most walks within the 40 tokens
        text, constraint = grammar_walk.drive(cache, smol_tokenizer, rf, random_logits(smol_tokenizer, seed),
                                              max_tokens=40, budget=True)
        if constraint.grammar_complete:
            finished += 1
            assert schema_errors(json.loads(text), schema) == [], text
    assert finished >= 2, f"only {finished} of 6 random walks finished"


@pytest.mark.parametrize("keyword,pointer,schema", REFUSED, ids=[r[0] + r[1] for r in REFUSED])
def test_unenforceable_shapes_are_refused_by_name(keyword: str, pointer: str, schema: dict) -> None:
    with pytest.raises(SchemaError) as err:
        check_schema(schema)
    assert (err.value.keyword, err.value.pointer) == (keyword, pointer)
    assert f'"{keyword}" at {pointer}' in str(err.value)
    assert f"{keyword} at {pointer}" in check_schema(schema, best_effort=True)
