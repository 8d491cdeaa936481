"""Fuzz structured output's inputs: JSON Schemas, EBNF grammars and regexes compiled for a real (tiny byte-level)
tokenizer and run for a few tokens, the tolerant JSON parser, and chat templates with message lists.

Property: success, or a typed edgellm error (SchemaError, GrammarError, StructuredOutputError, ChatTemplateError)
— never another exception, a crash of the process, or a hang.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgellm.errors import EdgeLLMError, SchemaError, StructuredOutputError  # noqa: E402
from edgellm.runtime.chat_template import ChatTemplateError, render_chat  # noqa: E402
from edgellm.generation import GenerationParams  # noqa: E402
from edgellm.structured import ResponseFormat  # noqa: E402
from edgellm.structured.tolerant import parse_tolerant  # noqa: E402
from tests.fuzz import examples, tally  # noqa: E402
from tests.fuzz.strategies import PATHOLOGICAL_PATTERNS, ebnf, json_values, messages, patterns, schemas  # noqa: E402
from tests.support.tiny_chat import tiny_chat_engine  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_chat_engine(tmp_path_factory.mktemp("tiny"))


def run_format(engine: Any, rf: ResponseFormat) -> None:
    """Compile `rf` and generate up to 3 tokens with it; only typed edgellm errors may come out."""
    try:
        chunks = list(engine.stream(engine.encode("Hi"), GenerationParams(max_tokens=3, temperature=0.0,
                                                                            response_format=rf)))
    except EdgeLLMError as exc:
        tally(f"refused: {type(exc).__name__}")
        assert str(exc).strip() and "\n" not in str(exc).strip(), repr(str(exc))
        return
    tally("generated")
    assert chunks and chunks[-1].finish_reason is not None


@settings(max_examples=examples(150))
@given(schema=schemas(), strict=st.booleans(), best_effort=st.booleans())
def test_json_schemas(engine: Any, schema: Any, strict: bool, best_effort: bool) -> None:
    run_format(engine, ResponseFormat("json_schema", schema=schema, strict=strict, best_effort=best_effort))


@settings(max_examples=examples(100))
@given(grammar=ebnf())
def test_ebnf_grammars(engine: Any, grammar: str) -> None:
    run_format(engine, ResponseFormat("grammar", grammar=grammar))


@settings(max_examples=examples(100))
@given(regex=patterns)
def test_regexes(engine: Any, regex: str) -> None:
    run_format(engine, ResponseFormat("regex", regex=regex))


@pytest.mark.parametrize("levels", [100, 200, 2000])
def test_deep_schemas_are_a_schema_error(engine: Any, levels: int) -> None:
    """Found by fuzzing: a schema 100 objects deep was a RecursionError out of the engine (the CLI's path)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    with pytest.raises(SchemaError, match="nested too deeply"):
        list(engine.stream(engine.encode("Hi"), GenerationParams(
            max_tokens=2, response_format=ResponseFormat("json_schema", schema=schema))))


def test_all_masked_step_is_a_typed_error(tmp_path: Any) -> None:
    """Found by fuzzing: a format no token can continue (JSON with a vocabulary of words t0..t253) made the sampler
    index an empty tensor (IndexError), or greedy decoding pick a forbidden token."""
    from tests.support.tiny import tiny_engine

    words = tiny_engine(tmp_path, "llama", tied=True)
    for temperature in (0.0, 1.0):
        with pytest.raises(StructuredOutputError, match="no token of this model's vocabulary"):
            list(words.stream([1, 2], GenerationParams(max_tokens=2, temperature=temperature,
                                                       response_format=ResponseFormat("json_object"))))


@pytest.mark.parametrize("pattern", PATHOLOGICAL_PATTERNS)
def test_pathological_patterns_in_schemas(engine: Any, pattern: str) -> None:
    run_format(engine, ResponseFormat("json_schema", schema={"type": "string", "pattern": pattern}))


def _dumps(value: Any) -> str | None:
    try:
        return json.dumps(value)
    except ValueError:
        return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b if not isinstance(a, (list, dict)) else json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@settings(max_examples=examples(200))
@given(value=json_values(20), before=st.sampled_from(["", "Sure! ", "```json\n", "<tool_call>\n", "{"]),
       after=st.sampled_from(["", " Hope it helps.", "\n```", "\n</tool_call>", "}", ","]),
       cut=st.integers(0, 1000) | st.none())
def test_tolerant_parser_on_json_like_text(value: Any, before: str, after: str, cut: int | None) -> None:
    text = _dumps(value)
    if text is None:
        return
    wrapped = before + text + after
    if cut is not None:
        wrapped = wrapped[:cut]
    result = parse_tolerant(wrapped)
    assert result.ok == (result.value is not None or result.tier != "raw")
    tally(f"tier {result.tier}")
    if wrapped == text:
        assert result.ok and result.tier == "strict" and _same(result.value, value)


@settings(max_examples=examples(200))
@given(text=st.text(max_size=200) | st.text(alphabet="{}[]\"':,\\ntruefalsnul0123456789.-+eE/*#` <>", max_size=300))
def test_tolerant_parser_on_any_text(text: str) -> None:
    result = parse_tolerant(text)
    assert isinstance(result.ok, bool) and result.tier in ("strict", "extracted", "lenient", "raw")
    assert result.ok or result.reason


@pytest.mark.parametrize("text", ["[" * 100_000, "{\"a\":" * 50_000, "```json\n" + "[" * 20_000 + "\n```",
                                  "'" + "\\" * 100_000, "/*" * 50_000, "{" * 30_000 + "}" * 30_000])
def test_tolerant_parser_on_huge_nesting(text: str) -> None:
    result = parse_tolerant(text)
    assert result.tier in ("strict", "extracted", "lenient", "raw")


TEMPLATE_PIECES = [
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "{{ messages[0]['content'] }}", "{{ messages[99] }}", "{{ raise_exception('no') }}", "{{ tools | tojson }}",
    "{% if add_generation_prompt %}assistant:{% endif %}", "{{ ''.__class__.__mro__ }}", "{{ m.x.y.z }}",
    "{% for i in range(10**9) %}x{% endfor %}", "{{ 'a' * 3 }}", "{{ bos_token }}{{ eos_token }}", "{{ 1 / 0 }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "{{ strftime_now('%Y') }}", "{% generation %}x",
    "{% generation %}x{% endgeneration %}", "{{", "{% for %}", "{{ messages | map(attribute='content') | join }}",
    "{{ cycler.__init__.__globals__ }}", "{{ (messages | first).content.upper() }}", "{% set x = namespace(a=1) %}",
]


@settings(max_examples=examples(150))
@given(template=st.lists(st.sampled_from(TEMPLATE_PIECES), min_size=1, max_size=3).map("".join)
       | st.text(alphabet="{}%#-+ ()[]'\"abcmesgrolnt.|_0123456789", max_size=40),
       msgs=messages(), tools=st.none() | st.lists(json_values(4), max_size=2))
def test_chat_templates_and_messages(template: str, msgs: Any, tools: Any) -> None:
    if not isinstance(msgs, list):
        msgs = [msgs]
    try:
        out = render_chat(template, msgs, tools=tools, bos_token="<s>", eos_token="</s>")
    except ChatTemplateError as exc:
        tally("ChatTemplateError")
        assert "\n" not in str(exc)
        return
    tally("rendered")
    assert isinstance(out, str)


@pytest.mark.parametrize("template", ["{{ 'a' * 10**12 }}", "{{ [0] * 10**12 }}", "{{ 3 ** 100000 }}",
                                      "{% set ns = namespace(a='a') %}{% for i in range(64) %}"
                                      "{% set ns.a = ns.a + ns.a %}{% endfor %}{{ ns.a | length }}"])
def test_templates_cannot_exhaust_memory(template: str) -> None:
    """Found while fuzzing templates: the sandbox let `*`, `+` and `**` build strings, lists and integers of any size
    (a template is code from the model file); each is now refused past a bound."""
    with pytest.raises(ChatTemplateError, match=r"^chat template refused: .*(limit|bits)"):
        render_chat(template, [{"role": "user", "content": "Hi"}])
    assert render_chat("{{ 'ab' * 3 }}{{ [1] + [2] }}{{ 2 ** 10 }}", []) == "ababab[1, 2]1024"
