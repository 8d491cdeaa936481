"""Chat templates: render a model's Jinja chat template the way Hugging Face does, in a sandbox."""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, cast

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.runtime import LoopContext
from jinja2.utils import _PassArg
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgellm.errors import EdgeLLMError


class ChatTemplateError(EdgeLLMError):
    """A chat template that fails to compile or render, calls `raise_exception`, or gets unusable messages."""


# A template is code from the model file; its render is bounded in what it may produce and how long it may run.
MAX_OUTPUT_CHARS = 4 << 20  # the rendered prompt
MAX_PRODUCED_CHARS = 64 << 20  # every string (and sequence item) the render builds, summed
MAX_STEPS = 1_000_000  # calls, filters, operators, loop iterations and outputs
MAX_RENDER_S = 5.0  # wall time of one render
MAX_INT_BITS = 1 << 16  # integers `*` and `**` may build
MAX_FORMAT_WIDTH = 1 << 16  # widths and precisions in `%` and str.format specs


class TemplateLimitError(ChatTemplateError):
    """A chat template that would build too much output or run too long."""


class _Budget:
    """What one render may still spend: steps, produced characters, wall time."""

    def __init__(self) -> None:
        self.steps = MAX_STEPS
        self.chars = MAX_PRODUCED_CHARS
        self.deadline = time.monotonic() + MAX_RENDER_S

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise TemplateLimitError(f"chat template refused: over its limit of {MAX_STEPS} steps")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"chat template refused: over its limit of {MAX_RENDER_S:g} s")

    def produce(self, chars: int) -> None:
        """Charge `chars` about to be built; refuse before building them when over the budget."""
        if chars > self.chars:
            raise TemplateLimitError(
                f"chat template refused: it builds over its limit of {MAX_PRODUCED_CHARS} characters")
        self.chars -= chars


_active: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _budget() -> _Budget:
    """The running render's budget; outside a render (Jinja folding constants at compile time) a fresh one."""
    return _active.get() or _Budget()


def _size(value: Any, limit: int) -> int:
    """An estimate of the characters `str(value)` (or its JSON) takes; the walk stops once past `limit`."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, Mapping):
            total += 2 + 2 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            stack.extend(item)
        else:
            total += 32
    return total


def _produced(value: Any) -> Any:
    """Charge a value just built (a string, a sequence) to the render's budget and return it."""
    if isinstance(value, (str, list, tuple, dict)):
        _budget().produce(len(value))
    return value


def _check_format(fmt: str, widths: re.Pattern[str]) -> None:
    for match in widths.finditer(fmt):
        for number in re.findall(r"\d+", match.group(0)):
            if len(number) > 6 or int(number) > MAX_FORMAT_WIDTH:
                raise TemplateLimitError(f"chat template refused: a format width over its limit of {MAX_FORMAT_WIDTH}")
        if "*" in match.group(0) or "{" in match.group(0)[1:]:
            raise TemplateLimitError("chat template refused: a format width taken from an argument")


_PERCENT_SPEC = re.compile(r"%[-#0 +()a-zA-Z_]*[*\d]*(?:\.[*\d]*)?")
_BRACE_SPEC = re.compile(r":[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")


def _width(value: Any) -> int:
    return len(value) if isinstance(value, str) else value if isinstance(value, int) else 0


def _replaced_size(text: str, old: str, new: str, count: int | None = None) -> int:
    hits = len(text) + 1 if old == "" else text.count(old)
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(0, len(new) - len(old))


def _str_method_size(text: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The characters a size-changing str method would build (0 for the others, whose result is at most its input)."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(text), _width(first))
    if name == "expandtabs":
        return len(text) * max(1, _width(first) if first is not None else 8)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return _replaced_size(text, args[0], args[1], args[2] if len(args) > 2 and isinstance(args[2], int) else None)
    if name == "join" and first is not None:
        items = list(first) if not isinstance(first, (list, tuple)) else first
        return _size(items, MAX_PRODUCED_CHARS) + len(text) * len(items)
    return 0


def _formatted_size(fmt: str, fields: int, values: Iterable[Any]) -> int:
    """The characters formatting `fmt` with `fields` replacement fields may build: each field the largest value."""
    largest = max((_size(v, MAX_PRODUCED_CHARS) for v in values), default=0)
    return len(fmt) + fields * largest


class _Sandbox(ImmutableSandboxedEnvironment):
    """Refuses unsafe attribute access outright (Jinja's default renders it as an empty undefined value), and keeps
    every render within its budget: each call, filter, operator, loop iteration and output is a step, and every
    string or sequence is charged before it is built (`_Budget`)."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "-", "/", "//"})
    code_generator_class: type[CodeGenerator]  # set below: buffers that charge what they hold

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.step()
        sized = (str, list, tuple)
        if operator == "*" and isinstance(left, sized + (int,)) and isinstance(right, sized + (int,)):
            if isinstance(left, int) and isinstance(right, int):
                _check_bits(left.bit_length() + right.bit_length())
            else:
                items, times = (left, right) if isinstance(left, sized) else (right, left)
                if isinstance(items, sized) and isinstance(times, int):
                    budget.produce(len(items) * max(times, 0))
        if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            budget.produce(len(left) + len(right))
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            _check_bits(max(left.bit_length(), 1) * right if abs(left) > 1 else 1)
        if operator == "%" and isinstance(left, str):
            _check_format(left, _PERCENT_SPEC)
            values = right.values() if isinstance(right, Mapping) else right if isinstance(right, tuple) else (right,)
            budget.produce(_formatted_size(left, left.count("%"), values))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any,  # noqa: N805 - Jinja's signature
             **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        if isinstance(__obj, LoopContext) and args:  # `loop(children)` in a recursive for loop
            args = (_counted(args[0]), *args[1:])
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and isinstance(getattr(__obj, "__name__", None), str):
            budget.produce(_str_method_size(owner, __obj.__name__, args, kwargs))
        return _produced(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`str.format` and `format_map` as the sandbox wraps them, refused for wide specs and charged beforehand."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt: str = value.__self__
        _check_format(fmt, _BRACE_SPEC)

        def checked(*args: Any, **kwargs: Any) -> str:
            mapping = args[0] if value.__name__ == "format_map" and args and isinstance(args[0], Mapping) else {}
            values = [*args, *kwargs.values(), *mapping.values()]
            _budget().produce(_formatted_size(fmt, fmt.count("{"), values))
            return wrapped(*args, **kwargs)

        return checked

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        """The template's syntax tree, with every for loop's items counted and every `~` charged."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("counted"), [loop.iter], [], None, None)
        for concat in list(tree.find_all(jinja2.nodes.Concat)):
            _replace_node(tree, concat, jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("joined"),
                                                          concat.nodes, [], None, None))
        return tree

    @staticmethod
    def counted(items: Any) -> Iterator[Any]:
        return _counted(items)

    @staticmethod
    def joined(*parts: Any) -> str:
        """`a ~ b ~ c`: the parts as text, charged before they are joined."""
        budget = _budget()
        budget.produce(sum(_size(part, budget.chars) for part in parts))
        return "".join(str(part) for part in parts)

    @staticmethod
    def new_buffer() -> list[str]:
        return _ChargedBuffer()


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateLimitError(f"chat template refused: an integer over its limit of {MAX_INT_BITS} bits")


def _counted(items: Any) -> Iterator[Any]:
    budget = _budget()
    for item in items:
        budget.step()
        yield item


def _replace_node(tree: jinja2.nodes.Node, old: jinja2.nodes.Node, new: jinja2.nodes.Node) -> None:
    """Put `new` where `old` is among the fields of its parent in `tree`."""
    for parent in tree.find_all(jinja2.nodes.Node):
        for field in parent.fields:
            value = getattr(parent, field, None)
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                setattr(parent, field, [new if v is old else v for v in value])
                return


class _ChargedBuffer(list[str]):  # holds what a macro, block or `set` renders
    """A render buffer whose every appended string is a step, charged to the render's budget."""

    def append(self, text: str) -> None:
        budget = _budget()
        budget.step()
        budget.produce(len(text))
        super().append(text)

    def extend(self, texts: Iterable[str]) -> None:
        for text in texts:
            self.append(text)


class _ChargingCodeGenerator(CodeGenerator):
    """Jinja's code generator with buffers from `environment.new_buffer()` (charged) instead of plain lists."""

    def buffer(self, frame: Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.new_buffer()")


_Sandbox.code_generator_class = _ChargingCodeGenerator


def _checked_finalize(value: Any) -> Any:
    """Every `{{ value }}`: refused before it is turned into text when that text would be over the budget."""
    budget = _budget()
    if not isinstance(value, str) and _size(value, budget.chars) > budget.chars:
        budget.produce(budget.chars + 1)
    return value


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


def _json_size(value: Any, *args: Any, **kwargs: Any) -> int:
    """The characters `tojson` may build: each item on its own line, indented to its depth, when indented."""
    indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
    width = _width(indent) if indent is not None else 0
    lines, deepest, stack = 0, 0, [(value, 1)]
    while stack and lines * (width * deepest + 1) <= MAX_PRODUCED_CHARS:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            lines += len(item) + 1
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            lines += len(item) + 1
            stack.extend((v, depth + 1) for v in item)
        deepest = max(deepest, depth)
    return 6 * _size(value, MAX_PRODUCED_CHARS) + (lines * (width * deepest + 1) if indent is not None else 0)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


def _indent_size(value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> int:
    text = _text(value)
    return len(text) + (text.count("\n") + 1) * _width(kwargs.get("width", width))


def _replace_size(value: Any, old: Any = "", new: Any = "", count: Any = None) -> int:
    text = _text(value)
    return _replaced_size(text, str(old), str(new), count if isinstance(count, int) else None)


def _join_size(value: Any, d: Any = "", *args: Any, **kwargs: Any) -> int:
    items = value if isinstance(value, (list, tuple)) else ()
    return _size(items, MAX_PRODUCED_CHARS) + len(str(kwargs.get("d", d))) * len(items)


def _format_size(value: Any, *args: Any, **kwargs: Any) -> int:
    _check_format(_text(value), _PERCENT_SPEC)
    return len(_text(value)) + _size(args, MAX_PRODUCED_CHARS) + _size(kwargs, MAX_PRODUCED_CHARS)


def _fill_size(value: Any, count: Any = 0, *args: Any, **kwargs: Any) -> int:
    return _size(value, MAX_PRODUCED_CHARS) + (count if isinstance(count, int) else 0)


def _wordwrap_size(value: Any, width: Any = 79, *args: Any, **kwargs: Any) -> int:
    wrap = kwargs.get("wrapstring", args[1] if len(args) > 1 else None)
    text = _text(value)
    return len(text) * (1 + len(wrap or "\n"))


def _center_size(value: Any, width: Any = 80) -> int:
    return max(len(_text(value)), _width(width))


# Filters whose output can outgrow their input many times over, with what they would build; every other filter's
# output is charged after it is built (at most a few times its input, already within the budget).
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "center": _center_size, "indent": _indent_size, "replace": _replace_size, "join": _join_size,
    "format": _format_size, "batch": _fill_size, "slice": _fill_size, "wordwrap": _wordwrap_size,
    "tojson": _json_size, "pprint": lambda value, *a, **k: 2 * _size(value, MAX_PRODUCED_CHARS),
    "string": lambda value, *a, **k: _size(value, MAX_PRODUCED_CHARS),
    "list": lambda value, *a, **k: _size(value, MAX_PRODUCED_CHARS),
}


def _budgeted(name: str, function: Callable[..., Any], *, is_filter: bool) -> Callable[..., Any]:
    """`function` as a step of the render, with what it builds charged (before, for the filters that amplify)."""
    size = _FILTER_SIZES.get(name) if is_filter else None
    passes = _PassArg.from_obj(function) is not None

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        if size is not None:
            budget.produce(size(*(args[1:] if passes else args), **kwargs))
        result = function(*args, **kwargs)
        return _produced(result) if is_filter else result

    return wrapper


def _strftime_now(fmt: str) -> str:
    _check_format(fmt, _PERCENT_SPEC)
    return datetime.now().strftime(fmt)


_ENV = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag],
                finalize=_checked_finalize)
_ENV.filters["tojson"] = _tojson
_ENV.filters = {name: _budgeted(name, f, is_filter=True) for name, f in _ENV.filters.items()}
# (jinja2 leaves its tests table typed as `function`, which mypy does not count as a Callable)
_ENV.tests = {name: _budgeted(name, cast(Callable[..., Any], f), is_filter=False) for name, f in _ENV.tests.items()}
del _ENV.globals["lipsum"]  # n paragraphs of filler on request: nothing a chat template needs
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {_one_line(e.message or str(e))}") from None


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
    budget = _Budget()
    token = _active.set(budget)
    try:
        parts, length = [], 0
        for part in compiled.generate(
            messages=[_normalize(i, m) for i, m in enumerate(messages)],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=tools,
            **extra,
        ):
            length += len(part)
            if length > MAX_OUTPUT_CHARS:
                raise TemplateLimitError(
                    f"chat template refused: its output is over its limit of {MAX_OUTPUT_CHARS} characters")
            budget.step()
            budget.produce(len(part))
            parts.append(part)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except RecursionError:
        raise TemplateLimitError("chat template refused: it recurses too deeply") from None
    except MemoryError:
        raise TemplateLimitError("chat template refused: it ran out of memory") from None
    except Exception as e:  # a template is code: any error in it is the template's, reported on one line
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_one_line(str(e))}") from None
    finally:
        _active.reset(token)


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
