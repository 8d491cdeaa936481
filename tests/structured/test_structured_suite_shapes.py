"""Shapes the JSON-Schema-Test-Suite showed refused or narrowed, compiled over the suite's one-character vocabulary
and checked against `jsonschema`: an untyped schema keeps every type its keywords do not constrain, `contains`
with `minContains`/`maxContains` is enforced, and the `idn-*` formats are held to ASCII (every accepted instance
valid; the narrowing named where it is one)."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator

from edgellm.bench import schema_suite as suite
from edgellm.structured.grammar import GrammarCache
from tests.support.suite_grammar import cache, compile_lenient  # noqa: F401 (fixture)

_INSTANCES: list[Any] = [None, True, 0, 1, 2, 2.5, "", "a", "abc", [], [1], [1, 2], [1, 2, 3], ["a", 1, 2],
                         [1, "a", 2], [1, 2, "a"], {}, {"a": 1}, {"a": "x"}, {"b": 1}]


@pytest.mark.parametrize("schema", [
    {"minLength": 2},
    {"maximum": 1},
    {"maxItems": 1},
    {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"items": {"type": "integer"}, "minProperties": 1},
    {"contains": {"type": "integer"}, "maxContains": 1, "minContains": 3},  # no array matches
    {"contains": False},
    {"minContains": 2},  # (ignored without contains)
])
def test_an_untyped_schema_accepts_exactly_what_jsonschema_does(cache: GrammarCache, schema: dict) -> None:
    compiled = compile_lenient(cache, schema)
    check = Draft202012Validator(schema)
    assert {repr(v): suite._accepts(compiled, v) for v in _INSTANCES} == {
        repr(v): check.is_valid(v) for v in _INSTANCES}
    assert compiled.narrowed == ()


@pytest.mark.parametrize("schema,must_accept", [
    ({"type": "array", "contains": {"type": "integer"}, "minContains": 2}, [[1, 2], [1, 2, "a"], [1, 2, 3]]),
    ({"type": "array", "contains": {"type": "integer"}, "minContains": 2, "maxContains": 2}, [[1, 2], [1, 2, "a"]]),
    ({"type": "array", "contains": {"const": 1}, "minContains": 0, "maxContains": 1}, [[]]),
    ({"contains": {"type": "string"}, "maxContains": 1}, [["a"], ["a", 1], 5, {}]),
])
def test_contains_counts_are_enforced_and_the_narrowing_named(cache: GrammarCache, schema: dict,
                                                              must_accept: list) -> None:
    compiled = compile_lenient(cache, schema)
    check = Draft202012Validator(schema)
    accepted = [v for v in [*_INSTANCES, *must_accept] if suite._accepts(compiled, v)]
    assert [v for v in accepted if not check.is_valid(v)] == []
    assert [v for v in must_accept if v not in accepted] == []
    assert any(n.startswith("contains at /contains:") for n in compiled.narrowed), compiled.narrowed


@pytest.mark.parametrize("fmt,plain", [("idn-email", "joe.bloggs@example.com"), ("idn-hostname", "example.com")])
def test_an_internationalized_format_is_held_to_ascii_and_the_narrowing_named(cache: GrammarCache, fmt: str,
                                                                               plain: str) -> None:
    schema = {"type": "string", "format": fmt}
    compiled = compile_lenient(cache, schema)
    check = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    candidates = [plain, "a@b.co", "x", "", "a@", "@b.co", "2962", "ab--c.com", "-a.com", "a_b.com", "xn--abc.com",
                  "\u5b9e@\u5b9e.\u6d4b", "\u5b9e\u4f8b.\u6d4b\u8bd5", "a" * 64 + ".com"]
    accepted = [v for v in candidates if suite._accepts(compiled, v)]
    assert [v for v in accepted if not check.is_valid(v)] == []
    assert plain in accepted
    assert [n.split(":")[0] for n in compiled.narrowed] == ["format at /format"], compiled.narrowed
