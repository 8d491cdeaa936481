"""JSON whitespace policy (docs/structured-output.md): compact by default, at most N characters per gap with
`max_whitespace=N`, unbounded with `max_whitespace=None` — checked on the grammar and on real generations
pushed towards whitespace."""

from __future__ import annotations


import pytest

from edgellm.generation import GenerationParams
from edgellm.runtime.engine import Engine
from edgellm.structured.grammar import compile_format, grammar_cache
from edgellm.structured.xgrammar_core import core
from edgellm.response_format import ResponseFormat

ASK = [{"role": "user", "content": "Give a JSON object with the key color set to a color name."}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("smollm2-135m", threads=1, progress=False)


def whitespace_outside_strings(text: str) -> list[tuple[str, str]]:
    """(the character before, the run) for each run of whitespace between JSON tokens (strings skipped)."""
    runs: list[tuple[str, str]] = []
    current, before, in_string, escaped = "", "", False, False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch in " \t\n\r":
            current += ch
        else:
            if current:
                runs.append((before, current))
            current, before, in_string = "", ch, ch == '"'
    return runs + ([(before, current)] if current else [])


def accepts(engine: Engine, rf: ResponseFormat, text: str) -> bool:
    compiled = compile_format(grammar_cache(engine.tokenizer, engine.config.model.vocab_size), rf)
    matcher = core().matcher(compiled.grammar)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("kind,schema", [("json_object", None), ("json_schema", SCHEMA)])
def test_grammar_whitespace_policy(engine: Engine, kind: str, schema: dict | None) -> None:
    def fmt(**kw: object) -> ResponseFormat:
        return ResponseFormat(kind, schema=schema, **kw)

    compact, pretty = '{"a": 1, "b": "x  y"}', '{\n  "a": 1,\n  "b": "x  y"\n}'
    assert accepts(engine, fmt(), compact)  # the default: fixed ", " and ": " separators ...
    for loose in (pretty, '{"a":1,"b":"x  y"}', '{ "a": 1, "b": "x  y"}', '{"a": 1, "b": "x  y"}\n'):
        assert not accepts(engine, fmt(), loose), loose  # ... and no other whitespace outside strings
    assert accepts(engine, fmt(max_whitespace=3), pretty)  # gaps of at most 3 characters
    assert not accepts(engine, fmt(max_whitespace=3), pretty.replace("  ", "   "))  # a 4-character gap
    assert accepts(engine, fmt(max_whitespace=None), pretty.replace("\n", "\n" * 50))


def test_generation_pushed_towards_newlines(engine: Engine) -> None:
    """Newline and space get +100: the grammar alone decides where whitespace may go."""
    bias = {engine.tokenizer.encode("\n")[0]: 100.0, engine.tokenizer.encode(" ")[0]: 100.0}

    def reply(max_whitespace: int | None) -> str:
        r = engine.chat(ASK, GenerationParams(max_tokens=30, temperature=0.0, logit_bias=bias,
                                              response_format=ResponseFormat("json_object",
                                                                             max_whitespace=max_whitespace)))
        assert r.finish_reason == "length" and r.complete is False  # whitespace forever, cut by max_tokens
        return r.text

    compact = whitespace_outside_strings(reply(0))
    assert compact and all(run == " " and before in ":," for before, run in compact)  # only ", " and ": "
    bounded = [run for _, run in whitespace_outside_strings(reply(3))]
    assert bounded and max(map(len, bounded)) == 3  # pushed to the bound, never past it
    assert max(len(run) for _, run in whitespace_outside_strings(reply(None))) > 3
