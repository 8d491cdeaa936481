"""The loop guard and the budget finish: loop detection on real looping values, steering under a real grammar with
scripted logits (deterministic, no model), and identical output when nothing loops."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from edgellm.runtime.tokenizer import Tokenizer
from edgellm.structured.grammar import GrammarCache
from edgellm.structured.loop_guard import (
    DEFAULT_LOOP_GUARD,
    JSONScanner,
    LoopGuardConfig,
    continues,
    find_loop,
    token_texts,
)
from edgellm.structured.processor import GrammarConstraint
from edgellm.structured.response_format import ResponseFormat
from edgellm.structured.validate import schema_errors
from tests import grammar_walk
from tests.grammar_walk import EOS, VOCAB, cache, smol_tokenizer  # noqa: F401 (fixtures)

# Real loops seen with smollm2-135m under a JSON grammar (issue 10), as the text of the open value.
LOOPING = [
    ("string", "2023-01-01T12:33:53.133-12:33:53.133-12:33:53.133-12:33:53.133"),
    ("string", "Aurora 2.1.1.1.1.1.1.1.1.1.1"),
    ("string", "12345678901234567890123456789012345678"),
    ("string", "Ava_12345678911123456789111234567891112345678911"),
    ("number", "3.14159265358979323846264338327950288419716939937"),
    ("array", '"Ava", "Ava", "Ava", "Ava", "Ava", "Ava"'),
]
# Ordinary values that must never count as a loop.
ORDINARY = [
    ("string", "2023-01-01T00:00:00Z"),
    ("string", "00000000-0000-4000-8000-000000000000"[:20]),
    ("string", "https://example.com/api/v1/users/1234"),
    ("string", "The quick brown fox jumps over the lazy dog. The quick brown fox"),
    ("string", "192.168.100.100"),
    ("string", "ab-ab-ab"),
    ("number", "1234567890123456"),
    ("number", "0.3333333333"),
    ("array", "0, 0, 0, 0, 0, 0"),
    ("array", '{"id": 1, "total": 10.99}, {"id": 2, "total": 11.99}, {"id": 3, "total": 12.99}, '),
]


@pytest.mark.parametrize("kind,text", LOOPING)
def test_real_loops_are_detected(kind: str, text: str) -> None:
    assert find_loop(kind, text, DEFAULT_LOOP_GUARD) is not None


@pytest.mark.parametrize("kind,text", ORDINARY)
def test_ordinary_values_are_not_loops(kind: str, text: str) -> None:
    assert find_loop(kind, text, DEFAULT_LOOP_GUARD) is None


def test_continuation_follows_the_period() -> None:
    loop = find_loop("string", "Aurora 2.1.1.1.1.1.1.1.1.1.1", DEFAULT_LOOP_GUARD)
    assert loop is not None and loop.period == 2
    assert continues(loop, ".") and continues(loop, ".1") and continues(loop, ".1.1")
    assert not continues(loop, "\"") and not continues(loop, ".2") and not continues(loop, "")
    digits = find_loop("number", "3.14159265358979323846264338327950288419716939937", DEFAULT_LOOP_GUARD)
    assert digits is not None and digits.period is None
    assert continues(digits, "51") and not continues(digits, ",")


def test_scanner_tracks_strings_numbers_and_arrays() -> None:
    s = JSONScanner()
    s.feed('{"a": "x\\"y')
    assert s.segments() == [("string", 'x\\"y', s.text.index("x"))]
    s.feed('", "b": [12')
    items = s.text.index("[") + 1
    assert s.segments() == [("number", "12", items), ("array", "12", items)]
    s.feed(', {"q')
    assert s.segments() == [("string", "q", len(s.text) - 1), ("array", '12, {"q', items)]  # object items count
    s.feed('"}]}')
    assert s.segments() == [] and s.stack == []


@pytest.mark.parametrize("bad", [dict(min_repeats=1), dict(penalty=0), dict(base=0.5), dict(close_after=0)])
def test_bad_config_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="loop guard"):
        LoopGuardConfig(**bad)


# ---- steering under a real grammar, with scripted logits --------------------------------------------------------
def scripted(tokenizer: Tokenizer, wanted: Callable[[str], str], close_bias: float = 3.0) -> Callable:
    """Logits of a 'model' that wants to write `wanted(text so far)` next: the longest token that is a prefix of
    it scores 10, shorter prefixes less; a token starting with a quote scores `close_bias`; EOS scores 5."""
    table = token_texts(tokenizer, VOCAB)

    def logits(text: str) -> torch.Tensor:
        out = torch.full((VOCAB,), -5.0)
        out[table.closers["string"]] = close_bias
        want = wanted(text)
        for i in tokenizer.encode(want[:16], add_bos=False)[:1]:
            out[i] = 10.0
        for n in range(1, min(len(want), 4) + 1):  # other tokenizations of the same text
            for i in tokenizer.encode(want[:n], add_bos=False)[:1]:
                if out[i] < 10.0:
                    out[i] = 6.0 + n * 0.1
        out[EOS] = 5.0
        return out

    return logits


def drive(cache: GrammarCache, tokenizer: Tokenizer, schema: dict, logits_of: Callable, *, guard: bool,
          max_tokens: int = 120, budget: bool = False) -> tuple[str, GrammarConstraint]:
    return grammar_walk.drive(cache, tokenizer, ResponseFormat("json_schema", schema=schema), logits_of,
                              guard=guard, budget=budget, max_tokens=max_tokens)


VERSION = {"type": "object", "properties": {"version": {"type": "string"}}, "required": ["version"]}
NUMBERS = {"type": "object", "properties": {"pi": {"type": "number"}, "tags": {"type": "array", "items": {
    "type": "string"}}}, "required": ["pi", "tags"]}


def _loop_after(prefix: str, cycle: str, tail: str = "") -> Callable[[str], str]:
    """A model that writes `prefix`, then repeats `cycle` forever (or, when `tail` is given, ends with it)."""
    def wanted(text: str) -> str:
        if len(text) < len(prefix):
            return prefix[len(text):]
        done = text[len(prefix):]
        if tail and done.endswith(tail):
            return ""
        return (cycle * 100)[len(done) % len(cycle):] if not tail else (cycle + tail)[len(done):] or tail
    return wanted


def test_a_looping_string_is_closed_and_valid(cache: GrammarCache, smol_tokenizer: Tokenizer) -> None:
    logits_of = scripted(smol_tokenizer, _loop_after('{"version": "Aurora 2', ".1"))
    text, constraint = drive(cache, smol_tokenizer, VERSION, logits_of, guard=False)
    assert not constraint.complete and ".1.1.1.1.1.1.1.1" in text  # without the guard it loops to the limit
    text, constraint = drive(cache, smol_tokenizer, VERSION, logits_of, guard=True)
    assert constraint.complete and constraint.guard_interventions >= 1
    assert schema_errors(json.loads(text), VERSION) == []
    assert len(text) < 80


def test_a_stubborn_digit_loop_is_closed_through_the_closing_tokens(cache: GrammarCache,
                                                                    smol_tokenizer: Tokenizer) -> None:
    # the model never wants to close (closing tokens are as unlikely as anything else): only the escalation and
    # the lift of ",", "}" (closing the number) end it
    logits_of = scripted(smol_tokenizer, _loop_after('{"pi": 3.', "14159265358979"), close_bias=-5.0)
    text, constraint = drive(cache, smol_tokenizer, NUMBERS, logits_of, guard=True, max_tokens=200)
    assert constraint.guard_interventions >= 1
    assert text.startswith('{"pi": 3.1415926535')
    assert '"tags": ' in text  # the number was closed and generation went on to the next property


def test_output_that_does_not_loop_is_identical(cache: GrammarCache, smol_tokenizer: Tokenizer) -> None:
    cases = [
        (VERSION, '{"version": "1.2.3"}'),
        (VERSION, '{"version": "2023-01-01T00:00:00Z"}'),
        (VERSION, '{"version": "00000000-0000-4000-8000-000000000000"}'),
        (NUMBERS, '{"pi": 3.14159, "tags": ["a", "b", "a", "b"]}'),
        (NUMBERS, '{"pi": 0, "tags": ["x", "x", "x"]}'),
    ]
    for schema, target in cases:
        logits_of = scripted(smol_tokenizer, lambda text, t=target: t[len(text):])
        off, c_off = drive(cache, smol_tokenizer, schema, logits_of, guard=False)
        on, c_on = drive(cache, smol_tokenizer, schema, logits_of, guard=True)
        assert on == off == target and c_on.guard_interventions == 0 and c_on.complete and c_off.complete


def test_the_guard_never_leaves_the_grammar(cache: GrammarCache, smol_tokenizer: Tokenizer) -> None:
    # a string that must be 40 characters: closing is forbidden until then, so the loop is penalized, never closed
    schema = {"type": "object", "properties": {"v": {"type": "string", "minLength": 40, "maxLength": 40}},
              "required": ["v"]}
    logits_of = scripted(smol_tokenizer, _loop_after('{"v": "', "ab"))
    text, constraint = drive(cache, smol_tokenizer, schema, logits_of, guard=True)
    assert constraint.complete and constraint.guard_interventions >= 1
    assert schema_errors(json.loads(text), schema) == []


def test_budget_finish_closes_in_time_and_says_so(cache: GrammarCache, smol_tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}}}, "required": ["name", "tags"]}
    logits_of = scripted(smol_tokenizer, _loop_after('{"name": "Ava", "tags": ["', "one two three four five six "))
    text, constraint = drive(cache, smol_tokenizer, schema, logits_of, guard=False, max_tokens=30)
    assert not constraint.complete and not constraint.budget_closed
    text, constraint = drive(cache, smol_tokenizer, schema, logits_of, guard=False, max_tokens=30, budget=True)
    assert constraint.budget_closed and not constraint.complete
    assert schema_errors(json.loads(text), schema) == []
    assert len(smol_tokenizer.encode(text, add_bos=False)) <= 30


# ---- the real model -----------------------------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {
    "type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]}
RELEASE = {"type": "object", "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                            "id": {"type": "string"}}, "required": ["name", "version", "id"]}


@pytest.fixture(scope="module")
def smol_engine(smollm2_gguf: Path):
    from edgellm.runtime.engine import Engine

    return Engine.load("smollm2-135m", progress=False, threads=2)


def _chat(engine, prompt: str, schema: dict, guard: bool):
    from edgellm.generation import GenerationParams

    params = GenerationParams(max_tokens=96, temperature=0.0, response_format=ResponseFormat("json_schema",
                                                                                             schema=schema))
    return engine.chat([{"role": "user", "content": prompt}], params if guard else replace(params, loop_guard=None))


def test_real_model_loop_is_steered_to_a_valid_reply(smol_engine) -> None:
    prompt = "Describe a person named Ava as JSON with name, age and tags."
    off = _chat(smol_engine, prompt, PERSON, guard=False)
    if off.finish_reason != "length":
        pytest.skip(f"smollm2-135m did not loop on this machine ({off.text!r}); nothing to steer")
    on = _chat(smol_engine, prompt, PERSON, guard=True)
    assert on.complete and on.stats.guard_interventions >= 1 and off.stats.guard_interventions == 0
    assert schema_errors(json.loads(on.text), PERSON) == []


def test_real_model_output_that_does_not_loop_is_identical(smol_engine) -> None:
    prompts = [("Give a software release as JSON: name, version and a long numeric id.", RELEASE),
               ("Describe a cat named Tom as JSON with name, age and tags.", PERSON),
               ("A release of the tool edgellm, as JSON.", RELEASE)]
    untouched = 0
    for prompt, schema in prompts:
        on, off = _chat(smol_engine, prompt, schema, True), _chat(smol_engine, prompt, schema, False)
        if on.stats.guard_interventions == 0:
            untouched += 1
            assert on.text == off.text and on.token_ids == off.token_ids
    print(f"\nguard untouched on {untouched}/{len(prompts)} non-looping prompts")
    assert untouched >= 1, "the guard fired on every prompt chosen because it does not loop"

