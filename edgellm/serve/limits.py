"""The server's stated request limits: one documented default each, a `serve` flag each, a 400 naming it.

Every limit is checked before any work that grows with the input (templating, schema compiling, generation), with
loops rather than recursion, so an oversize or deeply nested request costs the server a single pass over its JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Union

if TYPE_CHECKING:  # the CLI builds its `serve` flags from this module without the serve extra installed
    from edgellm.serve.errors import APIError
    from edgellm.serve.protocol import ChatCompletionRequest, CompletionRequest

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a signed 64-bit integer, what the sampler's generator takes


@dataclass(frozen=True)
class Limits:
    """What one request may ask for. The help text of each field is its `serve` flag's help."""

    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_prompts: int = 64
    max_stop: int = 16
    max_stop_chars: int = 256
    max_total_tokens: int = 16384
    max_tools: int = 128
    max_logit_bias: int = 300
    max_schema_depth: int = 64
    max_schema_bytes: int = 64 << 10
    max_enum: int = 1000
    max_pattern_chars: int = 1000
    max_grammar_bytes: int = 64 << 10


HELP = {
    "max_body_bytes": "request body size in bytes; more is 413",
    "max_messages": "messages in one chat request",
    "max_prompts": "prompts in one /v1/completions request (a list of strings)",
    "max_stop": "stop strings in one request",
    "max_stop_chars": "characters in one stop string",
    "max_total_tokens": "n x max_tokens (x prompts): tokens one request may ask to generate",
    "max_tools": "tools in one request",
    "max_logit_bias": "entries in logit_bias",
    "max_schema_depth": "nesting depth (objects and arrays) of a response_format or tool parameters schema",
    "max_schema_bytes": "size of a response_format or tool parameters schema, as compact JSON, in bytes",
    "max_enum": "values in one enum of a schema",
    "max_pattern_chars": "characters in a regex: a schema's pattern or a regex response_format",
    "max_grammar_bytes": "size of an EBNF grammar response_format in bytes",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One `--max-...` flag per limit, defaulting to the documented value."""
    group = parser.add_argument_group("request limits (a request over one gets 400 naming it)")
    for field in dataclasses.fields(Limits):
        group.add_argument(_flag(field.name), type=int, default=field.default, metavar="N",
                           help=f"{HELP[field.name]} (default {field.default})")


def limits_from_args(args: argparse.Namespace) -> Limits:
    """The Limits the parsed `serve` flags ask for; each must be at least 1."""
    defaults = Limits()
    values: dict[str, int] = {f.name: getattr(args, f.name, getattr(defaults, f.name))
                              for f in dataclasses.fields(Limits)}
    for name, value in values.items():
        if value < 1:
            from edgellm.errors import EdgeLLMError

            raise EdgeLLMError(f"{_flag(name)} must be at least 1, got {value}")
    return Limits(**values)


def _bad_request(message: str, param: str | None, code: str) -> APIError:
    from edgellm.serve.errors import APIError

    return APIError(400, message, param=param, code=code)


def over(limit: str, what: str, value: int | str, allowed: int, param: str | None) -> APIError:
    """The 400 for a request over `limit`: names the value, the limit and the flag that sets it."""
    return _bad_request(f"{what} is {value}; this server accepts at most {allowed} "
                        f"(limit {limit}, set by `edgellm serve {_flag(limit)}`)", param, "limit_exceeded")


def check_seed(seed: int | None, n: int) -> None:
    """The seeds seed..seed+n-1 must be signed 64-bit integers."""
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX - (n - 1):
        raise _bad_request(f"seed {seed} is outside the accepted range {SEED_MIN}..{SEED_MAX - (n - 1)} "
                           "(a signed 64-bit integer, less n - 1)", "seed", "invalid_value")


def check_request(body: Union[ChatCompletionRequest, CompletionRequest], limits: Limits, default_max_tokens: int, context_window: int) -> None:
    """Raise APIError (400) for the first limit `body` (a chat or completion request) is over."""
    n = body.n
    check_seed(body.seed, n)
    stops = body.stop_list()
    if len(stops) > limits.max_stop:
        raise over("max_stop", "the number of stop strings", len(stops), limits.max_stop, "stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise over("max_stop_chars", "the longest stop string's length", longest, limits.max_stop_chars, "stop")
    if body.logit_bias and len(body.logit_bias) > limits.max_logit_bias:
        raise over("max_logit_bias", "the number of logit_bias entries", len(body.logit_bias),
                   limits.max_logit_bias, "logit_bias")
    messages = getattr(body, "messages", None)
    if messages is not None and len(messages) > limits.max_messages:
        raise over("max_messages", "the number of messages", len(messages), limits.max_messages, "messages")
    prompt = getattr(body, "prompt", None)
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else 1
    if prompts > limits.max_prompts:
        raise over("max_prompts", "the number of prompts", prompts, limits.max_prompts, "prompt")
    asked = body.token_limit()
    param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    if asked is not None and asked >= context_window:
        raise _bad_request(f"{param} is too large: {asked}. This model's context window is {context_window} "
                           f"tokens, prompt included, so at most {context_window - 1} completion tokens fit",
                           param, "invalid_value")
    total = (asked if asked is not None else default_max_tokens) * n * prompts
    if total > limits.max_total_tokens:
        raise over("max_total_tokens", f"{param} x n x prompts ({asked or default_max_tokens} x {n} x {prompts})",
                   total, limits.max_total_tokens, param)
    tools = getattr(body, "tools", None) or []
    if len(tools) > limits.max_tools:
        raise over("max_tools", "the number of tools", len(tools), limits.max_tools, "tools")
    for tool in tools:
        check_schema_limits(tool.function.parameters, limits, "tools")
    if body.response_format is not None:
        check_format_limits(body.response_format, limits)


def check_format_limits(response_format: dict[str, Any], limits: Limits) -> None:
    """Size limits of a response_format: the schema (depth, size, enums, patterns), grammar and regex text."""
    kind = response_format.get("type")
    if kind == "grammar" and isinstance(response_format.get("grammar"), str):
        size = len(response_format["grammar"].encode("utf-8", "surrogatepass"))
        if size > limits.max_grammar_bytes:
            raise over("max_grammar_bytes", "the grammar's size in bytes", size, limits.max_grammar_bytes,
                       "response_format")
    if kind == "regex" and isinstance(response_format.get("regex"), str):
        if len(response_format["regex"]) > limits.max_pattern_chars:
            raise over("max_pattern_chars", "the regex's length", len(response_format["regex"]),
                       limits.max_pattern_chars, "response_format")
    check_schema_limits(response_format, limits, "response_format")


def _nodes(value: Any) -> Iterator[tuple[Any, int, Union[str, int, None]]]:
    """Every JSON value inside `value` with its depth and the key it sits under, walked without recursion."""
    stack: list[tuple[Any, int, Union[str, int, None]]] = [(value, 1, None)]
    while stack:
        node, depth, key = stack.pop()
        yield node, depth, key
        if isinstance(node, dict):
            stack.extend((v, depth + 1, k) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, i) for i, v in enumerate(node))


def _compact_size(value: Any, cap: int) -> int:
    """The size of `value` as compact JSON in bytes (counting stops early past `cap`), without recursion."""
    size = 0
    for node, _, key in _nodes(value):
        if isinstance(key, str):
            size += len(key.encode("utf-8", "surrogatepass")) + 4  # "key":  and a comma
        if isinstance(node, str):
            size += len(node.encode("utf-8", "surrogatepass")) + 3
        elif isinstance(node, (dict, list)):
            size += 2
        else:
            size += len(str(node)) + 1
        if size > cap:
            return size
    return size


def check_schema_limits(schema: Any, limits: Limits, param: str) -> None:
    """Depth, size, enum and pattern limits of a JSON document holding a schema (checked before any parsing)."""
    for node, depth, key in _nodes(schema):
        if depth > limits.max_schema_depth:
            raise over("max_schema_depth", "the schema's nesting depth", depth, limits.max_schema_depth, param)
        if key == "enum" and isinstance(node, list) and len(node) > limits.max_enum:
            raise over("max_enum", "the number of enum values", len(node), limits.max_enum, param)
        if key == "pattern" and isinstance(node, str) and len(node) > limits.max_pattern_chars:
            raise over("max_pattern_chars", "a pattern's length", len(node), limits.max_pattern_chars, param)
    size = _compact_size(schema, limits.max_schema_bytes)
    if size > limits.max_schema_bytes:
        raise over("max_schema_bytes", "the schema's size as compact JSON", f"over {limits.max_schema_bytes} bytes",
                   limits.max_schema_bytes, param)
