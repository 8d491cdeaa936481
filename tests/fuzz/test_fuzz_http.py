"""Fuzz the HTTP request surface: /v1/chat/completions and /v1/completions with generated bodies (every field and
nesting, random JSON, random bytes), served by a tiny random chat model in-process.

Property: 2xx with a well-formed completion (or SSE stream), or a 4xx with an OpenAI error body — never a 500, never
an `internal_error` event in a stream, and the server stays healthy.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgellm.serve.app import create_app  # noqa: E402
from edgellm.serve.limits import Limits  # noqa: E402
from tests.fuzz import examples  # noqa: E402
from tests.fuzz.strategies import SCALARS, json_values, messages, response_formats, schemas, tools  # noqa: E402
from tests.support.tiny_chat import tiny_chat_engine  # noqa: E402

MODEL = "tiny"
USER = [{"role": "user", "content": "Hi"}]
ERROR_KEYS = {"message", "type", "param", "code"}
# Generation on the tiny model is cheap, but keep every request small: at most 24 tokens per request.
LIMITS = Limits(max_total_tokens=24)


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    engine = tiny_chat_engine(tmp_path_factory.mktemp("tiny"))
    app = create_app(lambda: engine, MODEL, limits=LIMITS, timeout_s=60)
    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as client:  # a Host it answers
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield client
        assert client.get("/health").status_code == 200


def check_answer(r: Any) -> None:
    """The fuzz property for one HTTP answer."""
    assert r.status_code < 500, r.text[:500]
    event(f"HTTP {r.status_code}")
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"], error
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events, r.text[:500]
        for data in events:
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                assert chunk["error"]["code"] != "internal_error", chunk
            else:
                assert chunk["object"] in ("chat.completion.chunk", "text_completion"), chunk
        return
    body = r.json()
    assert body["object"] in ("chat.completion", "text_completion") and body["choices"], body


def _some(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The field's usual values (three times in four), or any JSON value instead."""
    return st.one_of(strategy, strategy, strategy, SCALARS)


def _sampling_fields() -> dict[str, st.SearchStrategy[Any]]:
    floats = st.floats(-3, 3) | st.sampled_from([float("nan"), float("inf"), 1e308])
    return {
        "max_tokens": _some(st.integers(1, 4) | st.sampled_from([0, -1, 255, 256, 10**9, 2**70])),
        "temperature": _some(floats), "top_p": _some(floats), "top_k": _some(st.integers(-1, 300)),
        "min_p": _some(floats), "presence_penalty": _some(floats), "frequency_penalty": _some(floats),
        "repetition_penalty": _some(floats),
        "logit_bias": _some(st.dictionaries(st.text(max_size=4) | st.integers(-2, 300).map(str),
                                            _some(st.floats(-200, 200)), max_size=4)),
        "n": _some(st.integers(-1, 4)),
        "seed": _some(st.integers(-(2**70), 2**70)),
        "stop": _some(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20)),
        "stream": _some(st.booleans()),
        "stream_options": _some(st.fixed_dictionaries({}, optional={"include_usage": _some(st.booleans())})),
        "response_format": response_formats(),
        "user": SCALARS, "metadata": json_values(4),
    }


def chat_bodies() -> st.SearchStrategy[dict[str, Any]]:
    named = st.fixed_dictionaries({"type": st.just("function"),
                                   "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])})})
    return st.fixed_dictionaries(
        {"model": st.sampled_from([MODEL, "gpt-4o", ""]) | SCALARS, "messages": st.just(USER) | messages()},
        optional={**_sampling_fields(),
                  "max_completion_tokens": _some(st.integers(1, 4) | st.just(10**9)),
                  "logprobs": _some(st.booleans()), "top_logprobs": _some(st.integers(-1, 25)),
                  "tools": tools(), "tool_choice": _some(st.sampled_from(["none", "auto", "required", "x"]) | named),
                  "parallel_tool_calls": SCALARS})


def plausible_chat_bodies() -> st.SearchStrategy[dict[str, Any]]:
    """Bodies a client library would send (right types, mostly in range), so most reach the engine."""
    text = st.text(max_size=30)
    message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                     "content": text | st.lists(st.fixed_dictionaries(
                                         {"type": st.just("text"), "text": text}), min_size=1, max_size=2)})
    fn = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "f"])},
                               optional={"parameters": schemas(4), "description": text})
    return st.fixed_dictionaries(
        {"model": st.just(MODEL), "messages": st.lists(message, min_size=1, max_size=4),
         "max_tokens": st.integers(1, 6)},
        optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 300),
                  "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2),
                  "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
                  "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100), max_size=4),
                  "n": st.integers(1, 3), "seed": st.integers(-(2**63), 2**63 - 4),
                  "stop": text | st.lists(st.text(min_size=1, max_size=4), max_size=4),
                  "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
                  "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
                  "response_format": st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x",
                                                                                                  "schema": s}},
                                               schemas(8)) | st.sampled_from([{"type": "json_object"}]),
                  "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": fn}),
                                    min_size=1, max_size=2, unique_by=lambda t: t["function"]["name"]),
                  "tool_choice": st.sampled_from(["none", "auto", "required"])})


def completion_bodies() -> st.SearchStrategy[dict[str, Any]]:
    prompts = (st.text(max_size=20) | st.lists(st.text(max_size=8), max_size=4)
               | st.lists(st.integers(-3, 300), max_size=8) | st.lists(SCALARS, max_size=3))
    return st.fixed_dictionaries(
        {"model": st.sampled_from([MODEL, "x"]), "prompt": _some(prompts)},
        optional={**_sampling_fields(), "logprobs": _some(st.integers(-1, 25)), "echo": _some(st.booleans()),
                  "suffix": _some(st.text(max_size=4)), "best_of": _some(st.integers(-1, 3))})


def _post(http: TestClient, path: str, body: Any) -> Any:
    return http.post(path, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})


@settings(max_examples=examples(150))
@given(body=chat_bodies())
def test_chat_bodies(http: TestClient, body: dict[str, Any]) -> None:
    check_answer(_post(http, "/v1/chat/completions", body))


@settings(max_examples=examples(150))
@given(body=plausible_chat_bodies())
def test_plausible_chat_bodies(http: TestClient, body: dict[str, Any]) -> None:
    check_answer(_post(http, "/v1/chat/completions", body))


@settings(max_examples=examples(100))
@given(body=completion_bodies())
def test_completion_bodies(http: TestClient, body: dict[str, Any]) -> None:
    check_answer(_post(http, "/v1/completions", body))


@settings(max_examples=examples(100))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=json_values(20))
def test_random_json_bodies(http: TestClient, path: str, body: Any) -> None:
    check_answer(_post(http, path, body))


VALID = json.dumps({"model": MODEL, "messages": USER, "max_tokens": 2}).encode()


@settings(max_examples=examples(150))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       raw=st.binary(max_size=300) | st.builds(lambda i, b: VALID[:i] + b + VALID[i + len(b):],
                                                st.integers(0, len(VALID)), st.binary(min_size=1, max_size=4)),
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]))
def test_random_bytes(http: TestClient, path: str, raw: bytes, content_type: str) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    check_answer(http.post(path, content=raw, headers=headers))


@settings(max_examples=examples(10))
@given(depth=st.integers(1, 3000), opener=st.sampled_from(["[", '{"a":']))
def test_deeply_nested_bodies(http: TestClient, depth: int, opener: str) -> None:
    """JSON nested thousands deep anywhere in the body: 4xx (Python's parser has a recursion limit)."""
    closer = "]" if opener == "[" else "}"
    deep = opener * depth + "1" + closer * depth
    raw = '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}], "metadata": ' + deep + "}"
    check_answer(http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}))
    raw = '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}], "response_format": ' \
          + '{"type": "json_schema", "json_schema": {"name": "x", "schema": ' + deep + "}}}"
    check_answer(http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}))


def test_the_model_path_answers(http: TestClient) -> None:
    """A sanity anchor: a plain request is served, so the properties above are not all vacuous 400s."""
    r = _post(http, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
