"""Chat templates: render a model's Jinja chat template the way Hugging Face does, in a sandbox."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgellm.errors import EdgeLLMError


class ChatTemplateError(EdgeLLMError):
    """A chat template that fails to compile or render, calls `raise_exception`, or gets unusable messages."""


# A template is code from the model file: `'a' * 10**10` or `2 ** 10**9` would exhaust memory or hang the process.
MAX_REPEATED = 1 << 20  # items a `*` or `+` may produce from a string or list
MAX_EXPONENT = 4096


class _Sandbox(ImmutableSandboxedEnvironment):
    """Refuses unsafe attribute access outright (Jinja's default renders it as an empty undefined value), and
    arithmetic that would build huge strings, lists or integers."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        sized = (str, list, tuple)
        if operator == "*" and isinstance(left, sized + (int,)) and isinstance(right, sized + (int,)):
            count, times = (left, right) if isinstance(left, sized) else (right, left)
            if isinstance(count, sized) and isinstance(times, int) and len(count) * times > MAX_REPEATED:
                raise SecurityError(f"the template repeats a sequence to over {MAX_REPEATED} items")
        if operator == "+" and isinstance(left, sized) and isinstance(right, sized) \
                and len(left) + len(right) > MAX_REPEATED:
            raise SecurityError(f"the template builds a sequence of over {MAX_REPEATED} items")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"the template raises to a power over {MAX_EXPONENT}")
        return super().call_binop(context, operator, left, right)


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template refused the conversation: {_one_line(str(message))}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes and takes only indent; HF's takes json.dumps options and does not escape.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {_one_line(e.message)}") from None


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` (OpenAI-style dicts) with a Jinja chat template, as HF's `apply_chat_template` does.

    Keys whose value is None are dropped (as HF does), and list-of-parts content becomes a string of its text parts
    joined by newlines. `tools` are JSON-schema dicts; `extra` are further template variables.
    """
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=[_normalize(i, m) for i, m in enumerate(messages)],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=tools,
            **extra,
        )
    except ChatTemplateError:
        raise
    except Exception as e:  # a template is code: any error in it is the template's, reported on one line
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_one_line(str(e))}") from None


def _normalize(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"message {index} is a {type(message).__name__}, not an object")
    out = {key: value for key, value in message.items() if value is not None}
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(f"message {index}: content part of type {kind!r} is not supported (text only)")
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split())
