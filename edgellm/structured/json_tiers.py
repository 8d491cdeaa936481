"""The fallback flow for JSON from a model: direct → tolerant → constrained retry → raw (seed 000 §3.4)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from edgellm.generation import GenerationParams, GenerationResult
from edgellm.response_format import ResponseFormat
from edgellm.structured.schema_support import check_schema
from edgellm.structured.tolerant import parse_tolerant
from edgellm.structured.generator import Generator
from edgellm.structured.validate import schema_errors

RETRY_TEMPERATURE = 0.0  # the retry is greedy: the lowest temperature there is


@dataclass(frozen=True)
class JSONOutcome:
    """What the flow produced. tier: "direct" | "tolerant" | "constrained_retry" | "raw".

    value is None unless ok; text is the output the value came from (for "raw", the first attempt's text);
    reason says why the earlier tiers failed (None for "direct"); result is the last generation run.
    """

    value: Any | None
    ok: bool
    tier: str
    text: str
    reason: str | None
    result: GenerationResult


def _run(engine: Generator, prompt: str | Sequence[dict[str, Any]], params: GenerationParams) -> GenerationResult:
    if isinstance(prompt, str):
        return engine.generate(prompt, params)
    return engine.chat(prompt, params)


def _problem(value: Any, schema: dict[str, Any] | None) -> str | None:
    if schema is None:
        return None
    errors = schema_errors(value, schema)
    return f"does not validate {errors[0]}" if errors else None


def generate_json(engine: Generator, messages_or_prompt: str | Sequence[dict[str, Any]], *,
                  schema: dict[str, Any] | None = None, params: GenerationParams | None = None) -> JSONOutcome:
    """Ask for JSON without a constraint first; parse strictly, then tolerantly; if both fail (or the value does
    not validate against `schema`), retry once greedily under the strict constraint; else return the raw text.

    An unsupported `schema` raises SchemaError up front, before anything is generated.
    """
    params = replace(params or GenerationParams(), response_format=None)
    if schema is not None:
        check_schema(schema)
    first = _run(engine, messages_or_prompt, params)
    parsed = parse_tolerant(first.text)
    if parsed.ok:
        problem = _problem(parsed.value, schema)
        if problem is None:
            tier = "direct" if parsed.tier == "strict" else "tolerant"
            reason = None if tier == "direct" else f"parsed after cleanup ({parsed.tier})"
            return JSONOutcome(parsed.value, True, tier, first.text, reason, first)
        why = f"the output {problem}"
    else:
        why = f"the output is not JSON ({parsed.reason})"
    rf = ResponseFormat("json_object") if schema is None else ResponseFormat("json_schema", schema=schema)
    retry = _run(engine, messages_or_prompt, replace(params, temperature=RETRY_TEMPERATURE, response_format=rf))
    if retry.complete:
        value = json.loads(retry.text)
        problem = _problem(value, schema)
        if problem is None:
            return JSONOutcome(value, True, "constrained_retry", retry.text, why, retry)
        why += f"; the constrained retry {problem}"
    else:
        why += f"; the constrained retry was incomplete (finish_reason {retry.finish_reason})"
    return JSONOutcome(None, False, "raw", first.text, why, retry)
