"""Structured output on the real embedded model (smollm2-135m, q4f16_1): schemas, json_object, streaming, limits."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from edgellm.errors import SchemaError, StructuredOutputError
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams
from edgellm.structured.json_tiers import generate_json
from edgellm.response_format import ResponseFormat
from edgellm.structured.validate import schema_errors
from tests.support.structured_cases import JSON_OBJECT_PROMPTS, SCHEMA_CASES

MAX_TOKENS = 80
# Room for the longest output the bounded schemas used below allow (strings of at most 40 characters, each
# at most 6 characters as a JSON escape, one character or more per token), so these replies finish on any CPU.
BOUNDED_MAX_TOKENS = 300


@pytest.fixture(scope="module")
def engine(smollm2_gguf: Path) -> Engine:
    return Engine.load("smollm2-135m", quantization="q4f16_1", threads=2, progress=False)


def _ask(engine: Engine, prompt: str, rf: ResponseFormat, i: int, **kw) -> object:
    sampled = i % 3 == 0  # every third request samples (seeded), the rest are greedy
    params = GenerationParams(max_tokens=kw.pop("max_tokens", MAX_TOKENS), temperature=0.8 if sampled else 0.0,
                              seed=i, response_format=rf, **kw)
    return engine.chat([{"role": "user", "content": prompt}], params)


def test_every_completed_schema_output_validates(engine: Engine) -> None:
    assert len(SCHEMA_CASES) >= 30
    stopped, valid, failures = 0, 0, []
    for i, (name, schema, prompt) in enumerate(SCHEMA_CASES):
        r = _ask(engine, prompt, ResponseFormat("json_schema", schema=schema), i)
        assert_compact(r.text)  # the constraint cannot make an output run away on whitespace
        if r.finish_reason != "stop":
            assert r.finish_reason == "length" and r.complete is False, (name, r.text)
            assert len(r.token_ids) == MAX_TOKENS, (name, r.text)
            continue
        stopped += 1
        assert r.complete is True, (name, r.text)
        errors = schema_errors(json.loads(r.text), schema)
        if errors:
            failures.append((name, r.text, errors))
        else:
            valid += 1
    print(f"\nschema outputs: {valid}/{stopped} finished outputs validate ({len(SCHEMA_CASES)} schemas, "
          f"{len(SCHEMA_CASES) - stopped} cut off by max_tokens={MAX_TOKENS})")
    assert not failures, failures


def _whitespace_gaps(text: str) -> list[tuple[str, str]]:
    """Each run of whitespace outside JSON string literals, with the character before it (text may be cut)."""
    gaps: list[tuple[str, str]] = []
    in_string = escaped = False
    i = 0
    while i < len(text):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c.isspace():
            j = i
            while j < len(text) and text[j].isspace():
                j += 1
            gaps.append((text[i - 1] if i else "", text[i:j]))
            i = j
            continue
        i += 1
    return gaps


def assert_compact(text: str) -> None:
    """The compact-JSON guarantee: outside strings, whitespace is only the one space of ", " and ": "."""
    bad = [(before, gap) for before, gap in _whitespace_gaps(text) if gap != " " or before not in ",:"]
    assert not bad, (bad, text)


def test_whitespace_gaps_sees_only_whitespace_outside_strings() -> None:
    assert _whitespace_gaps('{"a b": "c\\" d", "e":  [1,\n2]}') == [(":", " "), (",", " "), (":", "  "),
                                                                         (",", "\n")]
    with pytest.raises(AssertionError):
        assert_compact('{"a":\n\n1}')
    assert_compact('{"a": [1, 2], "b c": "d  e"}')


def test_json_object_mode_gives_objects_and_no_whitespace_runaway(engine: Engine) -> None:
    """Guarantees on every output: finished ones parse as objects, cut ones are `length` and incomplete,
    and none has free whitespace. How many finish within MAX_TOKENS depends on the CPU's bits: printed only."""
    assert len(JSON_OBJECT_PROMPTS) >= 20
    complete = 0
    for i, prompt in enumerate(JSON_OBJECT_PROMPTS):
        r = _ask(engine, prompt, ResponseFormat("json_object"), i)
        assert_compact(r.text)
        if r.finish_reason == "stop":
            assert r.complete is True
            assert isinstance(json.loads(r.text), dict), r.text
            complete += 1
        else:
            assert r.complete is False and r.finish_reason == "length" and len(r.token_ids) == MAX_TOKENS
            with pytest.raises(ValueError):
                json.loads(r.text)
    print(f"\njson_object: {complete}/{len(JSON_OBJECT_PROMPTS)} complete, all complete ones parse as objects")


def test_truncation_is_length_and_incomplete(engine: Engine) -> None:
    schema = SCHEMA_CASES[0][1]
    r = _ask(engine, "Give me a person's name and age.", ResponseFormat("json_schema", schema=schema), 1,
             max_tokens=4)
    assert r.finish_reason == "length" and r.complete is False and len(r.token_ids) == 4
    with pytest.raises(StructuredOutputError, match="incomplete"):
        engine.chat_json([{"role": "user", "content": "Give me a person."}], schema,
                         GenerationParams(max_tokens=4, temperature=0.0))


def test_chat_json_returns_a_validated_value(engine: Engine) -> None:
    schema = SCHEMA_CASES[0][1]
    value = engine.chat_json([{"role": "user", "content": "Give me a person's name and age."}], schema,
                             GenerationParams(max_tokens=BOUNDED_MAX_TOKENS, temperature=0.0))
    assert schema_errors(value, schema) == [] and set(value) == {"name", "age"}


def test_streaming_under_a_constraint_matches_generate(engine: Engine) -> None:
    rf = ResponseFormat("json_schema", schema=SCHEMA_CASES[3][1])
    params = GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, response_format=rf)
    messages = [{"role": "user", "content": "What color is the sky?"}]
    chunks = list(engine.stream_chat(messages, params))
    whole = engine.chat(messages, params)
    assert "".join(c.text for c in chunks) == whole.text
    assert all(c.finish_reason is None and c.complete is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "stop" and chunks[-1].complete is True
    assert json.loads(whole.text)["color"] in {"red", "green", "blue"}


def test_stop_string_inside_constrained_output_is_incomplete(engine: Engine) -> None:
    rf = ResponseFormat("json_schema", schema=SCHEMA_CASES[0][1])
    r = engine.chat([{"role": "user", "content": "Give me a person's name and age."}],
                    GenerationParams(max_tokens=BOUNDED_MAX_TOKENS, temperature=0.0, response_format=rf,
                                     stop=('"age"',)))
    assert r.finish_reason == "stop" and r.complete is False and '"age"' not in r.text
    assert r.text.startswith('{"name": ')


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 20, 0.9, 0.0),
                                                           (1.3, 0, 1.0, 0.1)])
def test_every_sampler_respects_the_grammar(engine: Engine, temperature: float, top_k: int, top_p: float,
                                            min_p: float) -> None:
    rf = ResponseFormat("regex", regex=r"(yes|no), [0-9]{2}")
    r = engine.chat([{"role": "user", "content": "Answer yes or no, then a number."}],
                    GenerationParams(max_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                     seed=5, repetition_penalty=1.3, response_format=rf))
    assert r.complete is True and r.finish_reason == "stop"
    assert r.text.split(", ")[0] in {"yes", "no"} and len(r.text.split(", ")[1]) == 2


def test_ebnf_grammar_constrains_output(engine: Engine) -> None:
    grammar = 'root ::= "Answer: " ("Paris" | "Lyon" | "Nice") "."'
    r = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                    GenerationParams(max_tokens=16, temperature=0.0, response_format=ResponseFormat("grammar",
                                                                                                    grammar=grammar)))
    assert r.complete is True and r.text in {"Answer: Paris.", "Answer: Lyon.", "Answer: Nice."}


def test_best_effort_reports_what_was_not_enforced(engine: Engine) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                        "minItems": 2, "maxItems": 3, "uniqueItems": True}},
              "required": ["tags"]}
    with pytest.raises(SchemaError):
        engine.chat([{"role": "user", "content": "Tags?"}],
                    GenerationParams(max_tokens=8, response_format=ResponseFormat("json_schema", schema=schema)))
    r = engine.chat([{"role": "user", "content": "Give three tags for a travel blog."}],
                    GenerationParams(max_tokens=BOUNDED_MAX_TOKENS, temperature=0.0,
                                     response_format=ResponseFormat("json_schema", schema=schema, best_effort=True)))
    assert r.unenforced == ("uniqueItems at /properties/tags/uniqueItems",)
    assert r.complete is True and isinstance(json.loads(r.text)["tags"], list)


class _ScriptedFirstReply:
    """The real engine, except that the unconstrained first attempt of the fallback flow answers `script`
    (a real one-token generation with its text replaced); constrained retries run on the real model."""

    def __init__(self, engine: Engine, script: str) -> None:
        self.engine = engine
        self.script = script
        self.calls: list[str] = []

    def chat(self, messages: Any, params: GenerationParams) -> Any:
        if params.response_format is None:
            self.calls.append("unconstrained")
            return replace(self.engine.chat(messages, replace(params, max_tokens=1)), text=self.script)
        self.calls.append("constrained")
        return self.engine.chat(messages, params)


PERSON = [{"role": "user", "content": "Give me a person's name and age."}]


@pytest.mark.parametrize("script,tier,reason", [
    ('{"name": "Ann", "age": 30}', "direct", None),
    ('Sure!\n```json\n{"name": "Ann", "age": 30,}\n```', "tolerant", "parsed after cleanup (lenient)"),
    ("I would rather not.", "constrained_retry", "the output is not JSON"),
    ('{"name": "Ann", "age": "thirty"}', "constrained_retry", "the output does not validate"),
])
def test_fallback_flow_reaches_each_tier(engine: Engine, script: str, tier: str, reason: str | None) -> None:
    schema = SCHEMA_CASES[0][1]
    scripted = _ScriptedFirstReply(engine, script)
    out = generate_json(scripted, PERSON, schema=schema,  # type: ignore[arg-type]
                        params=GenerationParams(max_tokens=BOUNDED_MAX_TOKENS, temperature=0.0))
    assert out.ok and out.tier == tier and schema_errors(out.value, schema) == []
    assert (out.reason is None) if reason is None else out.reason.startswith(reason), out.reason
    if tier == "constrained_retry":
        assert scripted.calls == ["unconstrained", "constrained"] and out.result.complete is True
        assert out.text == out.result.text and json.loads(out.text) == out.value
    else:
        assert scripted.calls == ["unconstrained"] and out.value == {"name": "Ann", "age": 30}


def test_fallback_flow_ends_raw_with_the_first_text_and_the_reason(engine: Engine) -> None:
    scripted = _ScriptedFirstReply(engine, "I would rather not.")
    # A budget too small for any JSON: the constrained retry is cut off too.
    raw = generate_json(scripted, PERSON, schema=SCHEMA_CASES[0][1],  # type: ignore[arg-type]
                        params=GenerationParams(max_tokens=3, temperature=0.0))
    assert not raw.ok and raw.tier == "raw" and raw.value is None and raw.text == "I would rather not."
    assert raw.reason.startswith("the output is not JSON") and "incomplete (finish_reason length)" in raw.reason
    assert raw.result.complete is False and scripted.calls == ["unconstrained", "constrained"]
