"""Structured output without generation: keyword support (from facts), errors, the OpenAI shape, the cache, masks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import numpy as np
from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for

from edgellm.errors import GrammarError, SchemaError
from edgellm.runtime.engine import Engine
from edgellm.generation import ConstraintReport, GenerationParams, Unconstrained
from edgellm.structured.xgrammar_core import core
from edgellm.tokenizer import Tokenizer
from edgellm.structured.grammar import GrammarCache, compile_format, grammar_cache, tokenizer_info
from edgellm.structured.processor import GrammarConstraint
from edgellm.response_format import ResponseFormat, response_format_from_openai
from edgellm.structured.schema_support import check_schema
from tests.support.tiny import VOCAB

FORMAT_CHECKER = Draft202012Validator.FORMAT_CHECKER
from tests.support.tiny import tiny_engine as make_tiny_engine


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    from edgellm.resolve import resolve_model

    return Tokenizer.from_file(resolve_model("smollm2-135m", quantization="q4f16_1", progress=False)
                               / "tokenizer.json", eos_token_id=2)


@pytest.fixture(scope="module")
def cache(smol_tokenizer: Tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer_info(smol_tokenizer, 49152, [2]), threads=1)


def _accepts(cache: GrammarCache, schema: dict, text: str) -> bool:
    compiled = compile_format(cache, ResponseFormat("json_schema", schema=schema, best_effort=True))
    matcher = core().matcher(compiled.grammar)
    return matcher.accept_string(text) and matcher.is_completed()


# (keyword, schema, an instance that breaks the keyword) -- each refused keyword is refused because the grammar
# really lets such an instance through; each supported one because it really does not.
REFUSED_FACTS = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 2}, "[1, 1]"),
    ("not", {"type": "integer", "not": {"const": 3}}, "3"),
    ("if", {"type": "string", "if": {"pattern": "^a"}, "then": {"pattern": "^ab"}}, '"ax"'),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ("multipleOf", {"type": ["integer", "string"], "multipleOf": 2000}, "2001"),  # xgrammar ignores steps > 1024
    ("minLength", {"type": "string", "pattern": "^[a-z]+$|^0$", "minLength": 3}, '"0"'),
    ("format", {"type": "string", "format": "regex", "pattern": "^[[(]+$"}, '"["'),
    ("$ref", {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}, "required": ["a"]},
     '{"a": "x"}'),  # (an optional property with a remote $ref is left out instead)
]
ENFORCED_FACTS = [
    ({"type": "integer", "multipleOf": 5}, "7"),
    ({"type": "integer", "minimum": 3, "maximum": 5}, "6"),
    ({"type": "number", "exclusiveMaximum": 1.5}, "1.5"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, "[1]"),
    ({"type": "string", "maxLength": 2}, '"北京市"'),
    ({"type": "string", "format": "date"}, '"2024-13-45"'),
    ({"type": "string", "format": "date"}, '"2024-02-31"'),  # the calendar too, not just the syntax
    ({"type": "string", "format": "date"}, '"2023-02-29"'),
    ({"type": "string", "format": "date-time"}, '"2024-04-31T10:00:00Z"'),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1}, '{"a": 1, "b": 2}'),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, "2"),
    # shapes xgrammar ignores on its own, rewritten by schema_normalize so that they are enforced:
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "2"),
    ({"$defs": {"P": {"type": "integer"}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/P", "minimum": 5}}, "required": ["a"]}, '{"a": 1}'),
    ({"patternProperties": {"[A-Za-z0-9-_.:]{1,255}": {"type": "string", "format": "uri"}}}, '{"a": "x y"}'),
    ({"patternProperties": {"[A-Za-z0-9-_.:]{1,255}": {"type": "string", "format": "uri"}}}, '{"a": 1}'),
    ({"minLength": 3}, '"a"'),
    ({"propertyNames": {"maxLength": 2}}, '{"abc": 1}'),
    ({"type": "object", "propertyNames": {"pattern": "^a"}, "additionalProperties": {"type": "integer"}},
     '{"b": 1}'),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": 3,
      "exclusiveMinimum": True}, "3"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "integer"}],
      "additionalItems": False}, "[1, 2]"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"],
      "anyOf": [{"required": ["b"]}]}, '{"b": "x"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "allOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, '{"b": 1}'),
    ({"type": "string", "enum": ["a", 1]}, "1"),
]


@pytest.mark.parametrize("keyword,schema,bad", REFUSED_FACTS, ids=[f[0] for f in REFUSED_FACTS])
def test_refused_keywords_are_really_unenforced(cache: GrammarCache, keyword: str, schema: dict, bad: str) -> None:
    assert _accepts(cache, schema, bad)  # the grammar lets a violating instance through...
    with pytest.raises(SchemaError) as err:  # ...so strict mode refuses the schema, naming keyword and pointer
        check_schema(schema)
    assert err.value.keyword == keyword and err.value.pointer.endswith(keyword)
    assert f'"{keyword}"' in str(err.value) and err.value.pointer in str(err.value)


@pytest.mark.parametrize("schema,bad", ENFORCED_FACTS)
def test_supported_keywords_are_really_enforced(cache: GrammarCache, schema: dict, bad: str) -> None:
    assert check_schema(schema) == ()
    assert not _accepts(cache, schema, bad)


@pytest.mark.parametrize("schema,text", [
    ({"type": "string", "format": "date"}, '"2024-02-29"'),
    ({"type": "string", "format": "date"}, '"2000-02-29"'),
    ({"type": "string", "format": "date"}, '"1969-07-20"'),
    ({"type": "string", "format": "date-time"}, '"2024-01-31T23:59:59.5+05:30"'),
])
def test_valid_dates_are_accepted(cache: GrammarCache, schema: dict, text: str) -> None:
    assert _accepts(cache, schema, text)


# Every assertion keyword of JSON Schema 2020-12, as `jsonschema` lists them (not our own table): a schema using it
# and an instance the keyword rejects.
SPEC_PROBES: dict[str, tuple[dict, str]] = {
    "$ref": ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p"}, '"a"'),
    "$dynamicRef": ({"$dynamicAnchor": "node", "type": "array", "items": {"$dynamicRef": "#node"}}, '[1]'),
    "additionalProperties": ({"type": "object", "properties": {"a": {}}, "additionalProperties": False},
                             '{"b": 1}'),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, '"a"'),
    "const": ({"const": 3}, "4"),
    "contains": ({"type": "array", "contains": {"const": 1}}, "[2]"),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "enum": ({"enum": [1, 2]}, "3"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, "5"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, "5"),
    "format": ({"type": "string", "format": "date"}, '"2024-13-01"'),
    "if": ({"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, "7"),
    "items": ({"type": "array", "items": {"type": "integer"}}, '["a"]'),
    "maxItems": ({"type": "array", "maxItems": 1}, "[1, 2]"),
    "maxLength": ({"type": "string", "maxLength": 2}, '"abc"'),
    "maxProperties": ({"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1}, '{"a": 1, "b": 2}'),
    "maximum": ({"type": "integer", "maximum": 5}, "6"),
    "minItems": ({"type": "array", "minItems": 2}, "[1]"),
    "minLength": ({"type": "string", "minLength": 2}, '"a"'),
    "minProperties": ({"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1}, "{}"),
    "minimum": ({"type": "integer", "minimum": 5}, "4"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4"),
    "not": ({"type": "integer", "not": {"const": 3}}, "3"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    "pattern": ({"type": "string", "pattern": "^a+$"}, '"b"'),
    "patternProperties": ({"type": "object", "patternProperties": {"^n_": {"type": "integer"}}}, '{"n_a": "x"}'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}]}, '["a"]'),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": "x"}'),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, '{"A": 1}'),
    "required": ({"type": "object", "properties": {"a": {}}, "required": ["a"]}, "{}"),
    "type": ({"type": "integer"}, '"a"'),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
                         "[1, 2]"),
    "unevaluatedProperties": ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
                              '{"b": 1}'),
    "uniqueItems": ({"type": "array", "uniqueItems": True, "minItems": 2}, "[1, 1]"),  # (minItems: no narrowing)
}


@pytest.mark.parametrize("keyword", sorted(Draft202012Validator.VALIDATORS))
def test_every_keyword_of_the_spec_is_enforced_or_refused_by_name(cache: GrammarCache, keyword: str) -> None:
    """No silent gap, judged against the spec's keyword list: the grammar rejects an instance the keyword
    rejects, or strict mode refuses the schema naming that keyword and its pointer (also one level down)."""
    schema, bad = SPEC_PROBES[keyword]
    validator = Draft202012Validator(schema, format_checker=FORMAT_CHECKER)
    assert not validator.is_valid(json.loads(bad)), "the probe must break the keyword"
    try:
        check_schema(schema)
    except SchemaError as err:
        assert err.keyword == keyword, str(err)
        nested = {"type": "object", "properties": {"x/y": schema}, "required": ["x/y"]}
        with pytest.raises(SchemaError) as inner:
            check_schema(nested)
        assert inner.value.keyword == keyword and inner.value.pointer.startswith("/properties/x~1y")
        assert check_schema(nested, best_effort=True)[0] == f"{keyword} at {inner.value.pointer}"
    else:
        assert not _accepts(cache, schema, bad), f"{keyword} is neither enforced nor refused"


def test_oneof_is_accepted_only_when_its_branches_cannot_overlap() -> None:
    assert check_schema({"oneOf": [{"type": "boolean"}, {"type": "string"}, {"const": None}]}) == ()
    for overlapping in ([{"const": 1}, {"type": "integer"}], [{"type": "integer"}, {"type": "number"}],
                        [{"type": "string"}, {"enum": ["a"]}]):
        with pytest.raises(SchemaError, match='"oneOf" at /oneOf'):
            check_schema({"oneOf": overlapping})


def test_a_oneof_with_two_branches_matching_everything_is_refused_as_matching_nothing() -> None:
    schema = {"oneOf": [True, {}, False]}
    assert not any(Draft202012Validator(schema).is_valid(v) for v in (None, 0, "a", [], {}))
    with pytest.raises(SchemaError, match="no value matches exactly one") as e:
        check_schema(schema)
    assert (e.value.keyword, e.value.pointer) == ("oneOf", "/oneOf")


def test_a_refusal_at_the_root_names_the_root() -> None:
    """A keyword found at the schema's root (pointer "") is named at "/" in the message, not at an empty place."""
    schema = {"type": "object", "required": ["a"], "additionalProperties": False}
    with pytest.raises(SchemaError, match=r'"required" at / cannot be enforced') as e:
        check_schema(schema)
    assert (e.value.keyword, e.value.pointer) == ("required", "")
    assert check_schema(schema, best_effort=True)[0] == "required at /"


def test_required_but_undeclared_property_is_refused_only_where_the_object_is_closed_by_its_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"]}
    assert check_schema(schema) == () and check_schema(schema, strict=False) == ()
    with pytest.raises(SchemaError, match="'z' is both required and forbidden"):
        check_schema({**schema, "additionalProperties": False})


@pytest.mark.parametrize("rf,error,pattern", [
    (ResponseFormat("json_schema", schema={"type": "strin"}), SchemaError, "malformed JSON schema at /type"),
    (ResponseFormat("json_schema", schema={"type": "integer", "minimum": "x"}), SchemaError, "at /minimum"),
    (ResponseFormat("json_schema", schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}),
     SchemaError, "invalid JSON schema"),
    (ResponseFormat("json_schema", schema=None), SchemaError, "needs a schema object"),
    (ResponseFormat("grammar", grammar='root ::= "a" | '), GrammarError, "invalid EBNF grammar"),
    (ResponseFormat("grammar", grammar='start ::= "a"'), GrammarError, "invalid EBNF grammar"),
    (ResponseFormat("regex", regex="(a|b"), GrammarError, "invalid regex"),
    (ResponseFormat("regex", regex=""), GrammarError, "non-empty"),
    (ResponseFormat("json_object", max_whitespace=-1), SchemaError, "max_whitespace"),
])
def test_malformed_formats_are_clear_errors(cache: GrammarCache, rf: ResponseFormat, error: type,
                                            pattern: str) -> None:
    with pytest.raises(error, match=pattern) as err:
        compile_format(cache, rf)
    assert "\n" not in str(err.value) and ".cc:" not in str(err.value)


def test_second_compile_of_a_schema_is_a_cache_hit(smol_tokenizer: Tokenizer) -> None:
    cache = grammar_cache(smol_tokenizer, 49152, threads=1)
    assert grammar_cache(smol_tokenizer, 49152) is cache  # one cache per tokenizer and vocabulary size
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    hits, misses = cache.hits, cache.misses
    first = compile_format(cache, ResponseFormat("json_schema", schema=schema))
    assert (cache.hits, cache.misses) == (hits, misses + 1)
    second = compile_format(cache, ResponseFormat("json_schema", schema=json.loads(json.dumps(schema))))
    assert (cache.hits, cache.misses) == (hits + 1, misses + 1) and second is first
    compile_format(cache, ResponseFormat("json_schema", schema=schema, strict=False))  # other options: a miss
    assert cache.misses == misses + 2


def test_padding_ids_and_eos_are_masked_until_the_grammar_accepts(smol_tokenizer: Tokenizer) -> None:
    padded = 49152 + 64  # a model whose logits are wider than the tokenizer (as Qwen's are)
    compiled = compile_format(grammar_cache(smol_tokenizer, padded), ResponseFormat("regex", regex="ab"))
    constraint = GrammarConstraint(compiled, padded, {2})
    logits = constraint.process([], np.zeros(padded, dtype=np.float32))
    assert np.isinf(logits[49152:]).all() and np.isinf(logits[2])
    for token in smol_tokenizer.encode("ab"):
        assert constraint.accept(token)
    assert constraint.finished and constraint.complete  # nothing but EOS may follow: done without sampling it
    assert not GrammarConstraint(compiled, padded, {2}).accept(smol_tokenizer.encode("zz")[0])


def test_the_constraint_reports_its_own_result(smol_tokenizer: Tokenizer) -> None:
    """Complete only where the grammar ended the output itself: not on a stop string, not at the length limit, not
    after a token it rejected; its narrowed and unenforced notes pass through; without a constraint, nothing."""
    compiled = compile_format(grammar_cache(smol_tokenizer, 49152), ResponseFormat("regex", regex="ab"))
    done = GrammarConstraint(compiled, 49152, {2})
    for token in smol_tokenizer.encode("ab"):
        assert done.accept(token)
    assert done.report("stop", stop_string=False) == ConstraintReport(
        "stop", complete=True, unenforced=compiled.unenforced, narrowed=compiled.narrowed)
    assert done.report("stop", stop_string=True).complete is False
    assert done.report("length", stop_string=False) == ConstraintReport(
        "length", complete=False, unenforced=compiled.unenforced, narrowed=compiled.narrowed)
    cut = GrammarConstraint(compiled, 49152, {2})
    assert cut.accept(smol_tokenizer.encode("a")[0]) and not cut.finished
    assert cut.report("length", stop_string=False).complete is False
    rejected = GrammarConstraint(compiled, 49152, {2})
    assert not rejected.accept(smol_tokenizer.encode("zz")[0])
    assert rejected.report("stop", stop_string=False).complete is False
    assert rejected.logits_processors() == (rejected.process,)
    free = Unconstrained()
    assert free.accept(5) and not free.finished and free.logits_processors() == ()
    assert free.report("stop", stop_string=True) == ConstraintReport("stop")


@pytest.mark.parametrize("stops", [{0, 2}, {2, 33}, {0, 2, 31, 32}])
def test_the_grammar_ends_whichever_stop_tokens_share_a_mask_word(smol_tokenizer: Tokenizer, stops: set[int]) -> None:
    """SmolLM2 stops on 0 and 2, one 32-bit word of the token mask: every stop token's bit is cleared before
    asking whether anything else may follow (only the last of them was, so a reply that ended its JSON on its
    last allowed token was `length`, and every finished one paid for sampling the forced EOS)."""
    compiled = compile_format(grammar_cache(smol_tokenizer, 49152), ResponseFormat("regex", regex="ab"))
    constraint = GrammarConstraint(compiled, 49152, stops)
    for token in smol_tokenizer.encode("ab"):
        assert constraint.accept(token)
    assert constraint.finished and constraint.complete


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return make_tiny_engine(tmp_path_factory.mktemp("structured"), "llama", tied=True)


def test_errors_are_raised_when_the_request_starts(tiny_engine: Engine) -> None:
    bad = ResponseFormat("json_schema", schema={"type": "array", "uniqueItems": True, "minItems": 2})
    with pytest.raises(SchemaError) as err:
        tiny_engine.stream("t1 t2", GenerationParams(max_tokens=4, response_format=bad))  # not even iterated
    assert err.value.keyword == "uniqueItems" and err.value.pointer == "/uniqueItems"
    with pytest.raises(GrammarError):
        tiny_engine.stream("t1", GenerationParams(response_format=ResponseFormat("regex", regex="[")))
    plain = tiny_engine.generate("t1 t2", GenerationParams(max_tokens=3, temperature=0.0))
    assert plain.complete is None and plain.unenforced == ()


def test_word_level_vocab_follows_a_regex(tiny_engine: Engine) -> None:
    r = tiny_engine.generate("t1 t2", GenerationParams(max_tokens=6, temperature=1.0, seed=3,
                                                       response_format=ResponseFormat("regex", regex="t7(t8)+")))
    assert r.token_ids[0] == 7 and set(r.token_ids[1:]) == {8} and len(r.token_ids) >= 2
    assert r.complete is (r.finish_reason == "stop") and all(t < VOCAB for t in r.token_ids)


@pytest.mark.parametrize("obj,expected", [
    ({"type": "text"}, ResponseFormat("text")),
    ({"type": "json_object"}, ResponseFormat("json_object")),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": False}},
     ResponseFormat("json_schema", schema={"type": "object"}, name="p", strict=False)),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}},
     ResponseFormat("json_schema", schema={"type": "object"}, name="p", strict=True)),
    ({"type": "grammar", "grammar": 'root ::= "a"'}, ResponseFormat("grammar", grammar='root ::= "a"')),
    ({"type": "regex", "regex": "a+"}, ResponseFormat("regex", regex="a+")),
])
def test_openai_shapes(obj: dict, expected: ResponseFormat) -> None:
    assert response_format_from_openai(obj) == expected


@pytest.mark.parametrize("obj,pattern", [
    ("json", "must be an object"),
    ({"type": "xml"}, "must be one of"),
    ({"type": "json_schema"}, '"json_schema" object'),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": "{}"}}, "schema must be a JSON Schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be a boolean"),
    ({"type": "grammar"}, "non-empty 'grammar'"),
    ({"type": "regex", "regex": 5}, "non-empty 'regex'"),
])
def test_invalid_openai_shapes(obj: object, pattern: str) -> None:
    with pytest.raises(SchemaError, match=pattern):
        response_format_from_openai(obj)


# ---- the keyword table of docs/structured-output.md, written from the docs (not from the code's tables) ----------
DOCS = Path(__file__).resolve().parents[2] / "docs" / "structured-output.md"
_OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
# (documented keyword, schema, an instance that keeps it, one that breaks it)
DOCUMENTED_ENFORCED = [
    ("type", {"type": "integer"}, "3", '"3"'),
    ("type", {"type": ["string", "null"]}, "null", "3"),
    ("enum", {"enum": ["red", "green"]}, '"red"', '"blue"'),
    ("const", {"const": "red"}, '"red"', '"green"'),
    ("properties", {**_OBJ, "required": ["a"]}, '{"a": 1}', '{"a": "1"}'),
    ("required", {**_OBJ, "required": ["a", "b"]}, '{"a": 1, "b": "x"}', '{"a": 1}'),
    ("additionalProperties", {"type": "object", "properties": {"a": {"type": "integer"}},
                              "additionalProperties": False}, '{"a": 1}', '{"a": 1, "z": 2}'),
    ("additionalProperties", {"type": "object", "additionalProperties": {"type": "integer"}}, '{"z": 2}',
     '{"z": "2"}'),
    ("patternProperties", {"type": "object", "patternProperties": {"n_.*": {"type": "integer"}},
                           "additionalProperties": False}, '{"n_a": 1}', '{"n_a": "x"}'),
    ("properties", {"type": "object", "properties": {"a": False}, "additionalProperties": {"type": "integer"}},
     '{"b": 1}', '{"a": 1}'),
    ("multipleOf", {"allOf": [{"type": "integer", "multipleOf": 3}, {"multipleOf": 5}]}, "15", "3"),  # lcm
    ("multipleOf", {"type": "integer", "multipleOf": 0.5}, "3", "3.5"),  # every integer is a multiple of 0.5
    ("multipleOf", {"type": "number", "multipleOf": 2}, "4", "3"),  # a number multiple of 2 is an integer
    ("multipleOf", {"type": "integer", "multipleOf": 4, "minimum": 1, "maximum": 20}, "8", "6"),  # xgrammar ignores
    ("multipleOf", {"type": "integer", "multipleOf": 5000, "minimum": 0, "maximum": 20000}, "15000", "1"),  # (both)  # a must-be-absent name of an open object: declared with a value never written
    ("properties", {"type": "object", "properties": {"foo": {"type": "array", "maxItems": 3}},
                    "patternProperties": {"f.o": {"minItems": 2}}, "additionalProperties": {"type": "integer"}},
     '{"foo": [1, 2]}', '{"foo": [1, 2, 3, 4]}'),  # the suite's properties/patternProperties interaction
    ("patternProperties", {"patternProperties": {"a*": {"type": "integer"}, "aaa*": {"maximum": 20}}},
     '{"aaaa": 18}', '{"aaaa": 31}'),  # a key matching two patterns gets both schemas
    ("required", {"required": ["__proto__", "toString"], "additionalProperties": {}}, '{"__proto__": 1, "toString": 2}', '{}'),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"},
                       "additionalProperties": {"type": "integer"}}, '{"ab": 1}', '{"zz": 1}'),
    ("minProperties", {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
     '{"a": 1, "b": 2}', '{"a": 1}'),
    ("maxProperties", {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
     '{"a": 1}', '{"a": 1, "b": 2}'),
    ("items", {"type": "array", "items": {"type": "integer"}}, "[1, 2]", '[1, "2"]'),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
     '[1, "a"]', '["a", 1]'),
    ("minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1, 2]", "[1]"),
    ("maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1, 2]", "[1, 2, 3]"),
    ("minimum", {"type": "integer", "minimum": 3}, "3", "2"),
    ("maximum", {"type": "integer", "maximum": 3}, "3", "4"),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1.5}, "1.25", "1.5"),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, "15", "7"),
    ("minLength", {"type": "string", "minLength": 3}, '"abc"', '"ab"'),
    ("maxLength", {"type": "string", "maxLength": 2}, '"北京"', '"北京市"'),  # characters, not bytes
    ("pattern", {"type": "string", "pattern": "^[0-9]{3}$"}, '"123"', '"12a"'),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"x"'),
    ("$ref", {"$defs": {"P": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/P"}},
              "required": ["a"]}, '{"a": 1}', '{"a": "1"}'),
    ("$ref", {"definitions": {"P": {"type": "integer"}}, "$ref": "#/definitions/P"}, "1", '"1"'),
    ("$ref", {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
              "required": ["next"]}, '{"next": {"next": null}}', '{"next": {"next": 1}}'),  # recursion
    # the docs' table lists unevaluatedItems next to applicators as refused; it is merged into the branches:
    ("unevaluatedItems", {"type": "array", "anyOf": [{"prefixItems": [{"type": "integer"}]},
                                                     {"prefixItems": [{"type": "string"}] * 2}],
                          "unevaluatedItems": False}, '["a", "b"]', '["a", "b", "c"]'),
    ("unevaluatedItems", {"type": "array", "allOf": [{"prefixItems": [{"type": "integer"}]}],
                          "unevaluatedItems": {"type": "string"}}, '[1, "a"]', "[1, 2]"),
    # rewritten (schema_normalize, schema_complement): exact here, narrowed where the docs say so
    ("if", {**_OBJ, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a": 1, "b": "x"}', '{"a": 1}'),
    ("then", {**_OBJ, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"b": "x"}', '{"a": 1}'),
    ("else", {**_OBJ, "if": {"required": ["a"]}, "else": {"required": ["b"]}}, '{"a": 1}', "{}"),
    ("not", {**_OBJ, "not": {"required": ["b"]}}, '{"a": 1}', '{"a": 1, "b": "x"}'),
    ("not", {"enum": ["x", "y", "z"], "not": {"const": "y"}}, '"x"', '"y"'),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1]", "[1, 1]"),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}}, "[7]", "[1]"),
    ("dependentRequired", {**_OBJ, "dependentRequired": {"a": ["b"]}}, '{"b": "x"}', '{"a": 1}'),
    ("dependentSchemas", {**_OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1, "b": "x"}',
     '{"a": 1}'),
    ("dependencies", {"$schema": "http://json-schema.org/draft-07/schema#", **_OBJ, "dependencies": {"a": ["b"]}},
     '{"a": 1, "b": "x"}', '{"a": 1}'),
    ("unevaluatedProperties", {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}],
                               "properties": {"b": {"type": "string"}}, "unevaluatedProperties": False},
     '{"b": "x", "a": 1}', '{"b": "x", "c": 2}'),  # xgrammar keeps the declared order
]
DOCUMENTED_FORMATS = [  # (format, a valid string, an invalid one)
    ("date", "2024-02-29", "2023-02-29"),
    ("date-time", "2024-01-31T23:59:59Z", "2024-01-31 23:59:59"),
    ("time", "23:59:59Z", "23:59"),
    ("duration", "P3DT4H", "3 days"),
    ("email", "ann@example.com", "ann at example.com"),
    ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567"),
    ("uri", "https://example.com/a?b=c", "no scheme here"),
    ("uri-reference", "/a/b?c", "a b"),
    ("uri-template", "/users/{id}", "/users/{id"),
    ("ipv4", "192.168.0.1", "192.168.0.256"),
    ("ipv6", "2001:db8::1", "2001:db8:::1"),
    ("hostname", "example.com", "exa mple.com"),
    ("json-pointer", "/a/b~1c", "a/b"),
    ("relative-json-pointer", "0/a", "/a"),
]
# (the keyword the error names, schema, its JSON pointer): one row per line of the docs' "Refused" table
DOCUMENTED_REFUSED = [
    ("not", {"type": "integer", "not": {"const": 3}}, "/not"),
    ("not", {"type": "string", "not": {"pattern": "^[^a]"}}, "/not"),
    ("if", {"type": "string", "if": {"pattern": "^a"}, "then": {"pattern": "^ab"}}, "/if"),
    ("uniqueItems", {"type": "array", "uniqueItems": True, "minItems": 2}, "/uniqueItems"),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"type": "string"}}, "/contains"),
    ("patternProperties", {"allOf": [{"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                                      "additionalProperties": False},
                                     {"type": "object", "patternProperties": {"^b": {"type": "integer"}}}]},
     "/allOf/1"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "/oneOf"),
    ("multipleOf", {"type": ["integer", "string"], "multipleOf": 3, "minimum": 1}, "/multipleOf"),
    ("minLength", {"type": "string", "pattern": "^a+$|^b$", "minLength": 2}, "/minLength"),
    ("maxLength", {"type": "string", "format": "email", "maxLength": 20}, "/maxLength"),
    ("format", {"type": "string", "pattern": "^a", "format": "email"}, "/format"),
    ("format", {"type": "string", "format": "regex", "pattern": "^[[(]+$"}, "/format"),
    ("format", {"type": "string", "format": "idn-email", "pattern": "^a"}, "/format"),
    ("format", {"type": "string", "format": "idn-hostname", "pattern": "^a"}, "/format"),
    ("$ref", {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}, "required": ["a"]},
     "/properties/a/$ref"),
    ("$ref", {"$defs": {"A": {"$anchor": "node", "type": "integer"}}, "type": "object",
              "properties": {"a": {"$ref": "#nowhere"}}, "required": ["a"]}, "/properties/a/$ref"),
    ("$dynamicRef", {"type": "object", "properties": {"a": {"$dynamicRef": "#node"}}}, "/properties/a/$dynamicRef"),
    ("$ref", {"$id": "https://example.com/root", "type": "object", "properties": {"a": {"$ref": "other.json"}},
              "required": ["a"]}, "/properties/a/$ref"),  # (no $id of this document names other.json)
    ("$recursiveRef", {"$schema": "https://json-schema.org/draft/2019-09/schema", "$id": "https://example.com/m",
                       "type": "object", "properties": {"n": {"$ref": "numbers"}, "s": {"$ref": "strings"}},
                       "$defs": {"generic": {"$id": "generic", "$recursiveAnchor": True,
                                             "items": {"$recursiveRef": "#"}},
                                 "numbers": {"$id": "numbers", "$recursiveAnchor": True, "$ref": "generic"},
                                 "strings": {"$id": "strings", "$recursiveAnchor": True, "$ref": "generic"}}},
     "/$defs/generic/items/$recursiveRef"),
    ("id", {"type": "object", "properties": {"a": {"id": "https://example.com/a", "type": "object",
                                                   "properties": {"b": {"$ref": "#/definitions/B"}},
                                                   "definitions": {"B": {"type": "integer"}}}}}, "/properties/a/id"),
    ("$ref", {"$defs": {"d0": {"type": "integer"}, **{  # 2**16 paths through allOf-wrapped $refs
        f"d{i}": {"type": "array", "prefixItems": [{"allOf": [{"$ref": f"#/$defs/d{i - 1}"}]} for _ in "ab"]}
        for i in range(1, 17)}}, "allOf": [{"$ref": "#/$defs/d16"}]}, ""),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"],
                  "additionalProperties": False}, ""),
    ("minProperties", {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2},
     "/minProperties"),
    ("oneOf", {"oneOf": [True, {}]}, "/oneOf"),
]


def _reference_validates(schema: dict, text: str) -> bool | None:
    """jsonschema's verdict on an instance (None for a format jsonschema does not assert)."""
    if "format" in schema and schema["format"] not in FORMAT_CHECKER.checkers:
        return None
    cls = validator_for(schema, default=Draft202012Validator)
    return cls(schema, format_checker=FORMAT_CHECKER).is_valid(json.loads(text))


@pytest.mark.parametrize("keyword,schema,good,bad", DOCUMENTED_ENFORCED + [
    ("format", {"type": "string", "format": f}, json.dumps(good), json.dumps(bad)) for f, good, bad in DOCUMENTED_FORMATS
], ids=[row[0] for row in DOCUMENTED_ENFORCED] + [f"format-{f}" for f, _, _ in DOCUMENTED_FORMATS])
def test_every_documented_enforced_keyword(cache: GrammarCache, keyword: str, schema: dict, good: str,
                                          bad: str) -> None:
    assert keyword in json.dumps(schema)
    assert check_schema(schema) == ()  # accepted in strict mode, nothing left unenforced
    assert _reference_validates(schema, good) in (True, None) and _reference_validates(schema, bad) in (False, None)
    assert _accepts(cache, schema, good), good
    assert not _accepts(cache, schema, bad), bad


@pytest.mark.parametrize("keyword,schema,pointer", DOCUMENTED_REFUSED, ids=[r[0] for r in DOCUMENTED_REFUSED])
def test_every_documented_refused_keyword(keyword: str, schema: dict, pointer: str) -> None:
    with pytest.raises(SchemaError) as err:
        check_schema(schema)
    assert (err.value.keyword, err.value.pointer) == (keyword, pointer)
    assert f'schema keyword "{keyword}" at {pointer or "/"} cannot be enforced' in str(err.value)
    try:
        assert f"{keyword} at {pointer or '/'}" in check_schema(schema, best_effort=True)
    except SchemaError as again:  # only a schema too complex to rewrite is refused in best-effort mode too
        assert "40000 subschemas" in str(again)


def test_annotations_are_ignored(cache: GrammarCache) -> None:
    schema = {"type": "object", "title": "T", "description": "d", "default": {}, "examples": [{"a": 1}],
              "markdownDescription": "m", "x-vendor": {"anything": True}, "$comment": "c",
              "properties": {"a": {"type": "integer", "description": "an integer", "deprecated": True}},
              "required": ["a"]}
    assert check_schema(schema) == ()
    assert _accepts(cache, schema, '{"a": 1}') and not _accepts(cache, schema, '{"a": "1"}')


def _docs_section(start: str, end: str) -> str:
    text = DOCS.read_text(encoding="utf-8")
    return text[text.index(start): text.index(end, text.index(start))]


def test_the_lists_above_cover_the_docs() -> None:
    """A keyword or format added to the docs' lists without a row above fails here."""
    name = re.compile(r"`(\$?[A-Za-z][A-Za-z-]*)`")
    enforced = set(name.findall(_docs_section("Enforced: ", "Annotations (")))
    covered = {row[0] for row in DOCUMENTED_ENFORCED} | {"format"} | {f for f, _, _ in DOCUMENTED_FORMATS}
    assert enforced - covered == set(), enforced - covered
    refused = set(name.findall(_docs_section("| `not` without", "Example: "))) - {"jsonschema"}
    mentioned = json.dumps([row[1] for row in DOCUMENTED_REFUSED + DOCUMENTED_ENFORCED])
    assert {k for k in refused if f'"{k}"' not in mentioned} == set()


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"n_.*": {"type": "integer"}, "a": {"type": "integer", "minimum": 5}},
     "additionalProperties": False},
    {"type": "object", "properties": {"n_a": {"type": "integer"}}, "required": ["n_a"],
     "patternProperties": {"a$": {"type": "integer", "minimum": 5}}},
])
def test_overlapping_property_patterns_are_enforced_or_refused(cache: GrammarCache, schema: dict) -> None:
    assert not Draft202012Validator(schema).is_valid({"n_a": 1})
    try:
        check_schema(schema)
    except SchemaError:
        return  # refused: fine
    assert not _accepts(cache, schema, '{"n_a": 1}')
