"""Every narrowing reported where the reply is: the rewrite lists each keyword the grammar enforces more tightly than
the schema (with its JSON pointer), the exact rewrites list nothing, and the list reaches `result.narrowed`, the
server's response body and `edgellm run`'s stderr."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from edgellm.generation import GenerationParams
from edgellm.response_format import ResponseFormat
from edgellm.structured.schema_support import prepare
from tests.cli.test_cli import edgellm

TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["tags"]}  # what pydantic writes for `tags: set[str]`
UNIQUE = "uniqueItems at /properties/tags/uniqueItems"


def _narrowed(schema: dict[str, Any], strict: bool = True) -> list[str]:
    return [f"{n.keyword} at {n.pointer}" for n in prepare(schema, strict=strict).narrowed]


@pytest.mark.parametrize("schema, expected", [
    (TAGS, UNIQUE),
    ({"type": "array", "contains": {"type": "integer"}}, "contains at /contains"),
    ({"type": "string", "pattern": "^https?://"}, "pattern at /pattern"),
    ({"type": "string", "pattern": "^[a-z](-?[a-z])*$", "maxLength": 39}, "maxLength at /maxLength"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, "patternProperties at /patternProperties/^a"),
    ({"type": "string", "format": "email"}, "format at /format"),
    ({"type": "array", "contains": {"type": "integer"}, "minContains": 2, "maxContains": 3}, "contains at /contains"),
    ({"type": "string", "format": "regex"}, "format at /format"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b": {"type": "integer", "minimum": 3}}},
     "patternProperties at /patternProperties/^a"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     "additionalProperties at /additionalProperties"),
    ({"type": "object", "properties": {"ref": {"$ref": "https://example.com/s.json"}}}, "$ref at /properties/ref"),
    ({"type": "string", "not": {"pattern": "^(BUILDKITE|BK)"}}, "not at /not"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
      "if": {"properties": {"a": {"pattern": "^x"}}}, "else": {"properties": {"a": {"maxLength": 3}}}},
     "if at /if"),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}},
                {"type": "object", "properties": {"a": {"type": "string", "pattern": "^y"}}}]}, "oneOf at /oneOf/0"),
])
def test_each_narrowing_is_listed_with_its_pointer(schema: dict[str, Any], expected: str) -> None:
    assert expected in _narrowed(schema), _narrowed(schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 1,
                                               "uniqueItems": True}}},  # one item is always unique
    {"type": "array", "maxItems": 1, "contains": {"type": "integer"}},
    {"type": "string", "pattern": "^[A-Za-z0-9_-]+$", "minLength": 2},  # `{2,}`: the same strings
    {"type": "string", "pattern": "^[a-z]+$"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]},
     "additionalProperties": {"type": "string"}},
    {"type": "object", "patternProperties": {"^a.*$": {"type": "integer"}, "^b.*$": {"type": "string"}},
     "additionalProperties": False},  # disjoint patterns matching whole keys, closed
    {"minLength": 2},  # untyped: every type, minLength on strings only
    {"type": "array", "contains": {"type": "integer"}, "minContains": 2, "maxItems": 2},
    {"type": "object", "properties": {"a": {"const": {"x": [1, 2]}}}},
])
def test_exact_rewrites_list_nothing(schema: dict[str, Any]) -> None:
    assert _narrowed(schema, strict=False) == []


def test_a_narrowing_in_a_reused_rewrite_is_listed_at_each_place() -> None:
    """The rewrite of a large node is kept and replayed where the same node comes again; its narrowings move with
    it (and one inside a definition is listed at the definition, where the keyword is written)."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 40} for i in range(8)}
           | {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    found = _narrowed({"type": "object", "properties": {"x": big, "y": big}})
    assert "uniqueItems at /properties/x/properties/tags/uniqueItems" in found, found
    assert "uniqueItems at /properties/y/properties/tags/uniqueItems" in found, found
    found = _narrowed({"type": "object", "$defs": {"d": big}, "properties": {"x": {"$ref": "#/$defs/d"}}})
    assert found == ["uniqueItems at /$defs/d/properties/tags/uniqueItems"], found


# ---- the three surfaces (the real default model) -------------------------------------------------------------
openai = pytest.importorskip("openai")
from tests.serve.test_serve_api import MODEL, engine, running_server, wait_ready  # noqa: E402, F401

PROMPT = [{"role": "user", "content": "Give three tags for a trip to Paris as JSON."}]


def test_python_result_lists_the_narrowing(engine: Any) -> None:
    params = GenerationParams(max_tokens=60, temperature=0.0, response_format=ResponseFormat("json_schema", TAGS))
    r = engine.chat(PROMPT, params)
    assert [n.split(":")[0] for n in r.narrowed] == [UNIQUE]
    chunks = list(engine.stream_chat(PROMPT, params))
    assert chunks[-1].narrowed == r.narrowed
    plain = engine.chat(PROMPT, GenerationParams(max_tokens=30, temperature=0.0, response_format=ResponseFormat(
        "json_schema", {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
                        "required": ["tags"]})))
    assert plain.narrowed == ()


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[Any]:
    with running_server(lambda: engine, max_queue=4) as url:
        wait_ready(url)
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_server_response_lists_the_narrowing(client: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS}}
    reply = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=60, temperature=0,
                                           response_format=fmt)
    narrowed = reply.choices[0].model_extra["narrowed"]
    assert [n.split(":")[0] for n in narrowed] == [UNIQUE]
    plain = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=20, temperature=0,
                                           response_format={"type": "json_object"})
    assert "narrowed" not in plain.choices[0].model_extra


def test_cli_run_prints_the_narrowing_on_stderr(tmp_path: Path) -> None:
    path = tmp_path / "tags.json"
    path.write_text(json.dumps(TAGS))
    proc = edgellm("run", MODEL, "Give three tags for a trip to Paris as JSON.", "--schema", str(path), "-n", "60",
                   "--temperature", "0", "--quiet")
    assert proc.returncode in (0, 3), proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "accepts less than the schema" in line]
    assert len(notes) == 1 and UNIQUE in notes[0], proc.stderr
    assert UNIQUE not in proc.stdout
