"""The engine-side description of a structured-output request (the server converts OpenAI's shape to it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from edgellm.errors import SchemaError
from edgellm.loop_guard_config import DEFAULT_LOOP_GUARD, LoopGuardConfig

FormatType = Literal["text", "json_object", "json_schema", "grammar", "regex"]


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must look like.

    type: "text" (unconstrained), "json_object" (any JSON object), "json_schema" (`schema`),
    "grammar" (EBNF text in `grammar`), "regex" (`regex`).
    best_effort: accept schema keywords the grammar cannot enforce, and report them in the
    result's `unenforced` instead of refusing the request.
    strict: no properties beyond those a schema declares (OpenAI's `strict`); False follows plain
    JSON Schema (extra properties allowed unless `additionalProperties` says otherwise).
    max_whitespace: JSON whitespace. 0 (default): compact one-line output with fixed separators
    `", "` and `": "` — no newline loops possible; N > 0: at most N whitespace characters between
    tokens (room for pretty-printing); None: unbounded (what most other engines do).
    """

    type: FormatType = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = True
    grammar: str | None = None
    regex: str | None = None
    best_effort: bool = False
    max_whitespace: int | None = 0


def guard_options_from_openai(obj: Any) -> dict[str, Any]:
    """The extension fields of a request's `response_format`: {"loop_guard": bool | {thresholds}, "budget_finish":
    bool} → GenerationParams keyword arguments (empty when absent). Raises SchemaError for a bad value."""
    if not isinstance(obj, dict):
        return {}
    out: dict[str, Any] = {}
    guard = obj.get("loop_guard", True)
    if isinstance(guard, bool):
        out["loop_guard"] = DEFAULT_LOOP_GUARD if guard else None
    elif isinstance(guard, dict):
        try:
            out["loop_guard"] = LoopGuardConfig(**guard)
        except (TypeError, ValueError) as e:
            raise SchemaError(f"response_format.loop_guard: {e}") from None
    else:
        raise SchemaError("response_format.loop_guard must be a boolean or an object of thresholds")
    budget = obj.get("budget_finish", False)
    if not isinstance(budget, bool):
        raise SchemaError("response_format.budget_finish must be a boolean")
    out["budget_finish"] = budget
    return out


def _need(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (isinstance(value, str) and not value):
        raise SchemaError(f"response_format{where} needs a non-empty {key!r} ({kind.__name__})")
    return value


def response_format_from_openai(obj: Any) -> ResponseFormat:
    """OpenAI's `response_format` object → ResponseFormat; raises SchemaError for shapes it does not accept.

    Accepts {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}, and the extensions {"type": "grammar", "grammar": EBNF} and {"type": "regex",
    "regex": PATTERN}.
    """
    if not isinstance(obj, dict):
        raise SchemaError(f"response_format must be an object, got {type(obj).__name__}")
    kind = obj.get("type")
    if kind == "text":
        return ResponseFormat("text")
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = obj.get("json_schema")
        if not isinstance(spec, dict):
            raise SchemaError('response_format of type "json_schema" needs a "json_schema" object '
                              'with "name" and "schema"')
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise SchemaError('response_format.json_schema.schema must be a JSON Schema object')
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise SchemaError("response_format.json_schema.name must be a string")
        strict = spec.get("strict", True)
        if strict is None:
            strict = True
        if not isinstance(strict, bool):
            raise SchemaError("response_format.json_schema.strict must be a boolean")
        return ResponseFormat("json_schema", schema=schema, name=name, strict=strict)
    if kind == "grammar":
        return ResponseFormat("grammar", grammar=_need(obj, "grammar", str, ' of type "grammar"'))
    if kind == "regex":
        return ResponseFormat("regex", regex=_need(obj, "regex", str, ' of type "regex"'))
    raise SchemaError(f"response_format.type must be one of text, json_object, json_schema, grammar, regex; "
                      f"got {kind!r}")
