"""The server end to end with the official `openai` client, against the real smollm2-135m on a loopback port."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

import uvicorn  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from edgellm.serve.app import create_app  # noqa: E402
from edgellm.serve.transport import Connections, uvicorn_config  # noqa: E402

MODEL = "smollm2-135m"
USER = [{"role": "user", "content": "What is the capital of France?"}]
# Above the longest output the bounded schemas below allow (strings of at most 30 characters, 6 characters
# each as a JSON escape, a token holds one character or more), so those replies finish on any CPU.
BOUNDED = 400


@contextmanager
def running_server(loader: Callable[[], Any], model_name: str = MODEL, **options: Any) -> Iterator[str]:
    """A real uvicorn server in a background thread on a free loopback port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    app = create_app(loader, model_name, **options)
    limits = options.get("connections") or Connections()
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, limits=limits, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            httpx.get(base + "/health", timeout=5)
            break
        except httpx.TransportError:
            time.sleep(0.1)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_ready(base: str) -> None:
    deadline = time.monotonic() + 120
    while httpx.get(base + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.1)


@functools.lru_cache(maxsize=1)
def _shared_engine() -> Any:
    from edgellm.runtime.engine import Engine

    return Engine.load(MODEL, progress=False, threads=2)


@pytest.fixture(scope="session")
def engine() -> Any:
    """One engine for every serve test module (each imports this fixture); servers use it one at a time."""
    return _shared_engine()


@pytest.fixture(scope="module")
def base(engine: Any) -> Iterator[str]:
    with running_server(lambda: engine, max_queue=4) as url:
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> Any:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_plain_chat(client: Any, engine: Any) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    # The engine's own greedy reply on this CPU (whether it names Paris depends on a near-tie: test_reference_gguf)
    from edgellm.generation import GenerationParams

    direct = engine.chat(USER, GenerationParams(max_tokens=12, temperature=0.0))
    assert choice.message.role == "assistant" and choice.message.content == direct.text
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    extra = u.model_extra
    assert extra["ttft_s"] > 0 and extra["decode_tokens_per_s"] > 0
    cached = u.prompt_tokens_details.cached_tokens  # earlier tests on this engine may have left a common prefix
    assert cached < u.prompt_tokens and extra["prefill_tokens_per_s"] > 0  # some of the prompt was prefilled
    # the time to first token covers the prefill: the prefilled tokens / prefill rate cannot exceed it
    assert (u.prompt_tokens - cached) / extra["prefill_tokens_per_s"] <= extra["ttft_s"] * 1.001


def test_content_parts_and_max_completion_tokens(client: Any) -> None:
    parts = [{"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
             {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    r = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=3, max_tokens=50, seed=2)
    assert r.usage.completion_tokens <= 3 and r.choices[0].finish_reason == "length"


def test_stream_equals_whole_reply_for_the_same_seed(client: Any) -> None:
    args = dict(model=MODEL, messages=USER, max_tokens=16, seed=7, temperature=0.9)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None  # usage comes in a final chunk of its own
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.model_extra["ttft_s"] > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_has_none(client: Any) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, stream=True))
    assert chunks and all(c.usage is None and c.choices for c in chunks)


def test_n_two_choices_with_consecutive_seeds(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, n=2, seed=11, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    first = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, seed=11, temperature=1.0)
    second = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, seed=12, temperature=1.0)
    assert r.choices[0].message.content == first.choices[0].message.content
    assert r.choices[1].message.content == second.choices[0].message.content
    assert r.usage.completion_tokens == first.usage.completion_tokens + second.usage.completion_tokens
    assert r.usage.prompt_tokens == first.usage.prompt_tokens


def test_logprobs_are_the_greedy_choice(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8") == r.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].token == item.token  # greedy picks the most likely token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        lps = [t.logprob for t in item.top_logprobs]
        assert lps == sorted(lps, reverse=True)


def test_stop_sequence_cuts_the_greedy_reply(client: Any) -> None:
    args = dict(model=MODEL, messages=USER, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**args).choices[0].message.content
    stop = full.split()[2]  # a word inside the reply, whichever words this CPU's greedy reply has
    assert len(full.split()) > 3 and full.index(stop) > 0
    r = client.chat.completions.create(stop=[stop, "zzzz"], **args)
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(stop=stop, stream=True, **args)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[: full.index(stop)]


def test_legacy_completions_with_logprobs_and_stream(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert r.object == "text_completion" and "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_json_object(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with the key color set to a color name."}])
    choice = r.choices[0]  # unbounded: whether it finishes within max_tokens depends on the CPU's bits
    assert choice.model_extra["complete"] is (choice.finish_reason == "stop"), choice
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and r.usage.completion_tokens == 60


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"enum": ["France", "Spain", "Italy"]}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def test_json_schema_in_openai_shape(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL, max_tokens=BOUNDED, temperature=0, messages=USER,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA,
                                                                "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY_SCHEMA)


class Capital(BaseModel):
    city: str
    is_capital: bool


def test_structured_output_helper_with_pydantic(client: Any) -> None:
    r = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Capital, max_tokens=60,
                                      temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Capital)
    assert Capital.model_validate_json(r.choices[0].message.content) == parsed


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"],
                   "additionalProperties": False}}}


def test_tool_call_required(client: Any) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=BOUNDED, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # the conversation goes on with the tool's answer
    follow = client.chat.completions.create(
        model=MODEL, max_tokens=8, tools=[WEATHER], tool_choice="none",
        messages=messages + [choice.message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}])
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.tool_calls is None


def test_tool_call_named_and_streamed(client: Any) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=40, temperature=0,
        stream=True)
    chunks = list(stream)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_time" and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), TIME["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_grammar_and_regex_extensions(client: Any) -> None:
    import re

    ask = [{"role": "user", "content": "Give me a phone number."}]
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=0,
                                       response_format={"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0.8, seed=3,
                                       response_format={"type": "grammar", "grammar": 'root ::= ("yes" | "no") "."'})
    assert r.choices[0].message.content in ("yes.", "no.")
    assert r.choices[0].model_extra["complete"] is True
