"""The engine's structured-output convenience: chat → parsed, schema-validated value."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from edgellm.errors import StructuredOutputError
from edgellm.generation import GenerationParams
from edgellm.response_format import ResponseFormat
from edgellm.structured.generator import Generator
from edgellm.structured.validate import schema_errors


def chat_json(engine: Generator, messages: Sequence[dict[str, Any]], schema: dict[str, Any] | None,
              params: GenerationParams | None = None, **render_kwargs: Any) -> Any:
    """Generate under `schema` (any JSON object when None) and return the parsed value.

    Raises SchemaError for an unsupported schema (before generating), StructuredOutputError when the output is
    incomplete (e.g. cut off by max_tokens) or does not validate with `jsonschema`.
    """
    params = params or GenerationParams()
    rf = ResponseFormat("json_object") if schema is None else ResponseFormat("json_schema", schema=schema)
    result = engine.chat(messages, replace(params, response_format=rf), **render_kwargs)
    if not result.complete:
        raise StructuredOutputError(
            f"the JSON output is incomplete (finish_reason {result.finish_reason}, "
            f"{result.stats.completion_tokens} tokens); raise max_tokens",
            text=result.text, finish_reason=result.finish_reason)
    try:
        value = json.loads(result.text)
    except ValueError as e:  # cannot happen for a complete grammar match; checked anyway
        raise StructuredOutputError(f"the output is not JSON: {e}", text=result.text,
                                    finish_reason=result.finish_reason) from None
    errors = schema_errors(value, schema) if schema is not None else []
    if errors:
        raise StructuredOutputError(f"the output does not validate against the schema {errors[0]}",
                                    text=result.text, finish_reason=result.finish_reason)
    return value
