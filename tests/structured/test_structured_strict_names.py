"""Strict mode closes an object to the names its schema gives: a name given only by `required` (directly, or through
`dependentRequired`/`dependentSchemas`) is admitted with any value in the objects that require it instead of
refused, and a `minProperties` above the declared names leaves objects out (listed) where the schema allows other
types, or is refused by name. Checked against `jsonschema` instance by instance over the suite runner's
one-character vocabulary."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator

from edgellm.bench import schema_suite as suite
from edgellm.errors import SchemaError
from edgellm.response_format import ResponseFormat
from edgellm.structured.grammar import CompiledFormat, GrammarCache, compile_format
from tests.support.suite_grammar import cache  # noqa: F401 (fixture)

_OBJECTS: list[Any] = [{}, {"a": 1}, {"z": 1}, {"z": "x"}, {"a": 1, "z": 2}, {"z": 1, "a": 1}, {"q": 1},
                       {"z": 1, "q": 1}, {"a": "x", "z": 1}, {"bar": 1}, {"foo": 1}, {"bar": 1, "foo": 2},
                       {"foo\tbar": 1}, {"__proto__": 1, "toString": 2}]
_OTHERS: list[Any] = [None, True, 0, 2.5, "", "a", [], [1]]


def _strict(cache: GrammarCache, schema: dict[str, Any]) -> CompiledFormat:
    out = compile_format(cache, ResponseFormat("json_schema", schema=schema))
    assert out is not None
    return out


@pytest.mark.parametrize("schema,must_accept", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"]},
     [{"z": 1}, {"z": "x"}, {"a": 1, "z": 2}]),
    ({"type": "object", "required": ["__proto__", "toString"]}, [{"__proto__": 1, "toString": 2}]),
    ({"type": "object", "dependentRequired": {"bar": ["foo"]}}, [{}, {"bar": 1, "foo": 2}]),
    ({"type": "object", "dependentSchemas": {"bar": {"properties": {"foo": {"type": "integer"}}}}}, [{}, {"bar": 1}]),
    ({"type": "object", "oneOf": [{"required": ["a", "z"]}, {"required": ["a", "q"]}]}, [{"a": 1, "z": 2}]),
])
def test_a_name_given_by_required_is_admitted_in_strict_mode(cache: GrammarCache, schema: dict,
                                                             must_accept: list) -> None:
    compiled = _strict(cache, schema)
    check = Draft202012Validator(schema)
    accepted = [v for v in [*_OBJECTS, *_OTHERS] if suite._accepts(compiled, v)]
    assert [v for v in accepted if not check.is_valid(v)] == []
    assert [v for v in must_accept if v not in accepted] == []
    assert accepted, "nothing accepted"


def test_minproperties_above_the_declared_names_leaves_objects_out_and_says_so(cache: GrammarCache) -> None:
    schema = {"minProperties": 1}
    compiled = _strict(cache, schema)
    check = Draft202012Validator(schema)
    assert {repr(v): suite._accepts(compiled, v) for v in _OTHERS} == {repr(v): check.is_valid(v) for v in _OTHERS}
    assert not any(suite._accepts(compiled, v) for v in _OBJECTS)
    assert [n.split(":")[0] for n in compiled.narrowed] == ["minProperties at /minProperties"], compiled.narrowed


def test_an_object_only_schema_below_its_minproperties_is_refused_by_name(cache: GrammarCache) -> None:
    with pytest.raises(SchemaError) as e:
        _strict(cache, {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2})
    assert (e.value.keyword, e.value.pointer) == ("minProperties", "/minProperties")
