"""Structured output without generation: keyword support (from facts), errors, the OpenAI shape, the cache, masks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgellm.errors import GrammarError, SchemaError
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams
from edgellm.runtime.tokenizer import Tokenizer
from edgellm.structured.grammar import GrammarCache, compile_format, grammar_cache, tokenizer_info
from edgellm.structured.processor import GrammarConstraint
from edgellm.structured.response_format import ResponseFormat, response_format_from_openai
from edgellm.structured.schema_support import UNENFORCEABLE, check_schema
from tests.tiny import VOCAB
from tests.tiny import tiny_engine as make_tiny_engine


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    from edgellm.resolve import resolve_model

    return Tokenizer.from_file(resolve_model("smollm2-135m", quantization="q4f16_1", progress=False)
                               / "tokenizer.json", eos_token_id=2)


@pytest.fixture(scope="module")
def cache(smol_tokenizer: Tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer_info(smol_tokenizer, 49152, [2]), threads=1)


def _accepts(cache: GrammarCache, schema: dict, text: str) -> bool:
    import xgrammar as xgr

    compiled = compile_format(cache, ResponseFormat("json_schema", schema=schema, best_effort=True))
    matcher = xgr.GrammarMatcher(compiled.grammar)
    return matcher.accept_string(text) and matcher.is_completed()


# (keyword, schema, an instance that breaks the keyword) -- each refused keyword is refused because the grammar
# really lets such an instance through; each supported one because it really does not.
REFUSED_FACTS = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ("not", {"type": "integer", "not": {"const": 3}}, "3"),
    ("if", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}'),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, "1.3"),
    ("minLength", {"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, '"ab"'),
    ("format", {"type": "string", "format": "regex"}, '"["'),
    ("$ref", {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, '{"a": "x"}'),
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
    ({"patternProperties": {"[A-Za-z0-9-_.:]{1,255}": {"type": "string", "format": "uri"}}}, '"not an object"'),
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


def test_every_listed_keyword_is_refused_with_its_pointer() -> None:
    values = {"uniqueItems": True, "minContains": 1, "maxContains": 1, "$dynamicRef": "#node", "$recursiveRef": "#"}
    assert set(values) < set(UNENFORCEABLE)
    for keyword in UNENFORCEABLE:
        schema = {"type": "object", "properties": {"x/y": {keyword: values.get(keyword, {})}}}
        with pytest.raises(SchemaError) as err:
            check_schema(schema)
        assert err.value.keyword == keyword and err.value.pointer == f"/properties/x~1y/{keyword}"
        assert check_schema(schema, best_effort=True)[0] == f"{keyword} at /properties/x~1y/{keyword}"


def test_oneof_is_accepted_only_when_its_branches_cannot_overlap() -> None:
    assert check_schema({"oneOf": [{"type": "boolean"}, {"type": "string"}, {"const": None}]}) == ()
    for overlapping in ([{"const": 1}, {"type": "integer"}], [{"type": "integer"}, {"type": "number"}],
                        [{"type": "string"}, {"enum": ["a"]}]):
        with pytest.raises(SchemaError, match='"oneOf" at /oneOf'):
            check_schema({"oneOf": overlapping})


def test_required_but_undeclared_property_is_refused_in_strict_mode() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"]}
    with pytest.raises(SchemaError, match="'z' is not declared"):
        check_schema(schema)
    assert check_schema(schema, strict=False) == ()


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
    logits = constraint.process([], torch.zeros(padded))
    assert torch.isinf(logits[49152:]).all() and torch.isinf(logits[2])
    for token in smol_tokenizer.encode("ab"):
        assert constraint.accept(token)
    assert constraint.finished and constraint.complete  # nothing but EOS may follow: done without sampling it
    assert not GrammarConstraint(compiled, padded, {2}).accept(smol_tokenizer.encode("zz")[0])


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return make_tiny_engine(tmp_path_factory.mktemp("structured"), "llama", tied=True)


def test_errors_are_raised_when_the_request_starts(tiny_engine: Engine) -> None:
    bad = ResponseFormat("json_schema", schema={"type": "array", "uniqueItems": True})
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
