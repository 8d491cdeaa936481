"""Structured output: constrain generation to JSON, a JSON Schema, an EBNF grammar or a regex.

`ResponseFormat` goes into `GenerationParams.response_format`; `parse_tolerant` and `generate_json` handle
unconstrained output; `response_format_from_openai` converts OpenAI's request shape. xgrammar is imported only
when a constrained request runs.
"""

from edgellm.response_format import ResponseFormat, response_format_from_openai

__all__ = ["ResponseFormat", "response_format_from_openai"]
