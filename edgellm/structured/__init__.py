"""Structured output: constrain generation to JSON, a JSON Schema, an EBNF grammar or a regex."""

from edgellm.structured.response_format import ResponseFormat

__all__ = ["ResponseFormat"]
