"""Schemas compiled over the JSON-Schema-Test-Suite runner's one-character vocabulary (bench/schema_suite.py), for
tests that check what a grammar accepts against `jsonschema` instance by instance."""

from __future__ import annotations

from typing import Any

import pytest

from edgellm.bench import schema_suite as suite
from edgellm.response_format import ResponseFormat
from edgellm.structured.grammar import CompiledFormat, GrammarCache, compile_format


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    return suite.suite_cache()


def compile_lenient(cache: GrammarCache, schema: dict[str, Any]) -> CompiledFormat:
    """`schema` compiled without strict mode (the suite's own setting); it must compile."""
    out = compile_format(cache, ResponseFormat("json_schema", schema=schema, strict=False))
    assert out is not None
    return out
