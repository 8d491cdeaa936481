"""The wire → engine conversion and the tool-call reader, without a server."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("fastapi")

from edgellm.serve.engine_request import to_engine  # noqa: E402
from edgellm.serve.errors import APIError  # noqa: E402
from edgellm.serve.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from edgellm.serve.responses import parse_tool_calls  # noqa: E402
from tests.serve.test_serve_api import MODEL, TIME, USER, WEATHER, engine  # noqa: E402,F401


def test_n_runs_in_order_with_consecutive_seeds(engine: Any) -> None:  # noqa: F811
    plan = to_engine(ChatCompletionRequest(model=MODEL, messages=USER, n=3, seed=5, stop="x",
                                           logit_bias={"42": -100}), engine)
    assert [p.seed for p in plan.params] == [5, 6, 7]
    assert plan.params[0].stop == ("x",) and plan.params[0].logit_bias == {42: -100.0}
    assert plan.prompts[0] == engine.encode(engine.render(USER)) and len(plan.prompts) == 3
    unseeded = to_engine(ChatCompletionRequest(model=MODEL, messages=USER, n=2), engine)
    assert [p.seed for p in unseeded.params] == [None, None]


def test_completion_prompt_lists_and_token_ids(engine: Any) -> None:  # noqa: F811
    plan = to_engine(CompletionRequest(model=MODEL, prompt=["a", "b"], n=2, max_tokens=3), engine)
    assert plan.prompts == tuple([engine.encode("a")] * 2 + [engine.encode("b")] * 2)
    assert plan.params[0].max_tokens == 3
    ids = to_engine(CompletionRequest(model=MODEL, prompt=[1, 2, 3]), engine)
    assert ids.prompts == ([1, 2, 3],) and ids.params[0].max_tokens == 16  # OpenAI's default for completions


def test_max_completion_tokens_wins_and_logprobs_map(engine: Any) -> None:  # noqa: F811
    req = ChatCompletionRequest(model=MODEL, messages=USER, max_tokens=50, max_completion_tokens=7, logprobs=True)
    params = to_engine(req, engine).params[0]
    assert params.max_tokens == 7 and params.top_logprobs == 0
    assert to_engine(ChatCompletionRequest(model=MODEL, messages=USER), engine).params[0].top_logprobs is None


def test_forced_tool_choice_constrains_to_name_and_arguments(engine: Any) -> None:  # noqa: F811
    req = ChatCompletionRequest(model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice="required")
    plan = to_engine(req, engine)
    fmt = plan.params[0].response_format
    assert plan.tool_mode == "forced" and plan.tool_names == ("get_weather", "get_time")
    assert fmt is not None and fmt.type == "json_schema"
    branches = fmt.schema["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert branches[0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    prompt = engine.tokenizer.decode(plan.prompts[0])  # smollm2's template has no tools: they go in the system text
    assert "get_weather" in prompt and "Current time in a timezone" in prompt
    named = to_engine(ChatCompletionRequest(model=MODEL, messages=USER, tools=[WEATHER, TIME],
                                            tool_choice={"type": "function", "function": {"name": "get_time"}}),
                      engine)
    assert named.params[0].response_format.schema["properties"]["name"] == {"const": "get_time"}
    none = to_engine(ChatCompletionRequest(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none"), engine)
    assert none.tool_mode == "none" and "get_weather" not in engine.tokenizer.decode(none.prompts[0])
    with pytest.raises(APIError, match="not in tools"):
        to_engine(ChatCompletionRequest(model=MODEL, messages=USER, tools=[WEATHER],
                                        tool_choice={"type": "function", "function": {"name": "nope"}}), engine)


def test_assistant_tool_calls_are_replayed_as_json(engine: Any) -> None:  # noqa: F811
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    plan = to_engine(ChatCompletionRequest(model=MODEL, messages=messages, tools=[WEATHER]), engine)
    prompt = engine.tokenizer.decode(plan.prompts[0])
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt and "rain" in prompt


def test_parse_tool_calls() -> None:
    names = ["get_weather", "get_time"]
    calls = parse_tool_calls('{"name": "get_weather", "arguments": {"city": "Paris"}}', names)
    assert calls and calls[0]["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    tagged = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>', names)
    assert tagged and tagged[0]["function"]["name"] == "get_time"
    pair = parse_tool_calls('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]',
                            names)
    assert pair and [c["function"]["name"] for c in pair] == ["get_time", "get_weather"]
    assert parse_tool_calls("The weather in Paris is sunny.", names) is None
    assert parse_tool_calls('{"name": "launch_rockets", "arguments": {}}', names) is None
    assert parse_tool_calls('{"name": "get_time", "arguments": "UTC"}', names) is None
    assert parse_tool_calls('{"color": "red"}', names) is None
    assert parse_tool_calls('{"name": "get_time", "arguments": {"tz": "UT', names) is None  # truncated
