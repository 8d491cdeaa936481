"""The engine-side description of a structured-output request (the server converts OpenAI's shape to it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FormatType = Literal["text", "json_object", "json_schema", "grammar", "regex"]


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must look like.

    type: "text" (unconstrained), "json_object" (any JSON object), "json_schema" (`schema`),
    "grammar" (EBNF text in `grammar`), "regex" (`regex`).
    best_effort: accept schema keywords the grammar cannot enforce, and report them in the
    result's `unenforced` instead of refusing the request.
    """

    type: FormatType = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = True
    grammar: str | None = None
    regex: str | None = None
    best_effort: bool = False
