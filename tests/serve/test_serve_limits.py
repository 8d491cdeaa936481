"""Stated request limits and the bugs a new user's odd requests found (issue 16), through a real loopback server
with the official `openai` client and httpx, on a tiny random chat model (fast): each limit answers 400
`limit_exceeded` naming the limit and its `serve` flag, a request at the limit is served, nothing is a 500."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from edgellm.errors import EdgeLLMError  # noqa: E402
from edgellm.serve.limits import SEED_MAX, SEED_MIN, Limits, add_limit_args, limits_from_args  # noqa: E402
from tests.support.tiny_chat import tiny_chat_engine  # noqa: E402
from tests.serve.test_serve_api import running_server, wait_ready  # noqa: E402

MODEL = "smollm2-135m"  # the name running_server gives the app
USER = [{"role": "user", "content": "t1 t2 t3"}]
SMALL = Limits(max_body_bytes=32 * 1024, max_messages=4, max_prompts=3, max_stop=2, max_stop_chars=8,
               max_total_tokens=40, max_tools=2, max_logit_bias=3, max_schema_depth=12, max_schema_bytes=2000,
               max_enum=5, max_pattern_chars=20, max_grammar_bytes=100)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_chat_engine(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def default_base(tiny: Any) -> Iterator[str]:
    with running_server(lambda: tiny) as url:
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def small_base(tiny: Any) -> Iterator[str]:
    with running_server(lambda: tiny, limits=SMALL) as url:
        wait_ready(url)
        yield url


def client(base: str) -> Any:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(base: str, path: str = "/v1/chat/completions", **body: Any) -> httpx.Response:
    defaults = {"model": MODEL, "max_tokens": 2}
    if path.endswith("chat/completions"):
        defaults["messages"] = USER
    else:
        defaults["prompt"] = "t1 t2"
    return httpx.post(base + path, json={**defaults, **body}, timeout=60)


def error_of(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# ---- the four bugs of the issue -----------------------------------------------------------------------------
def test_huge_seed_is_400_naming_the_range(default_base: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(default_base).chat.completions.create(model=MODEL, messages=USER, max_tokens=2, seed=2**70)
    error = info.value.body
    assert error["param"] == "seed" and str(SEED_MAX) in error["message"] and str(SEED_MIN) in error["message"]
    # the edges of the range are served; with n = 3 the last seed used is seed + 2
    for seed in (SEED_MIN, SEED_MAX):
        r = client(default_base).chat.completions.create(model=MODEL, messages=USER, max_tokens=2, seed=seed)
        assert r.choices[0].finish_reason == "length"
    assert error_of(post(default_base, seed=SEED_MAX, n=3))["param"] == "seed"
    assert post(default_base, seed=SEED_MAX - 2, n=3).status_code == 200


def test_schema_nested_200_deep_is_400_naming_the_limit(default_base: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(default_base).chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                                     response_format=schema_format(nested_schema(200)))
    error = info.value.body
    assert error["code"] == "limit_exceeded" and "max_schema_depth" in error["message"]
    assert "--max-schema-depth" in error["message"] and error["param"] == "response_format"


def test_schema_at_the_depth_limit_compiles(default_base: str) -> None:
    """The default depth (64) is one that jsonschema and xgrammar handle: 31 nested objects are served."""
    levels = (Limits.max_schema_depth - 4) // 2  # the schema sits 2 deep; each object is 2 levels, the leaf 2
    r = post(default_base, max_tokens=4, response_format=schema_format(nested_schema(levels)))
    assert r.status_code == 200, r.text


def test_max_tokens_beyond_the_window_is_400(default_base: str, tiny: Any) -> None:
    window = tiny.context_window
    with pytest.raises(openai.BadRequestError) as info:
        client(default_base).chat.completions.create(model=MODEL, messages=USER, max_tokens=1_000_000_000)
    error = info.value.body
    assert error["param"] == "max_tokens" and str(window) in error["message"]
    error = error_of(post(default_base, max_tokens=None, max_completion_tokens=window))
    assert error["param"] == "max_completion_tokens"
    # the most that fits is served; generation stops when the window is full
    r = post(default_base, max_tokens=window - 1, logit_bias={str(tiny.config.tokenizer.eos_token_id): -100})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= window


def test_null_content_is_400_except_assistant_tool_calls(default_base: str) -> None:
    for role in ("user", "system", "tool"):
        error = error_of(post(default_base, messages=[{"role": role, "content": None}] + USER))
        assert error["param"] == "messages.0" and "null" in error["message"]
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "t5"}]
    assert post(default_base, messages=ok).status_code == 200
    assert error_of(post(default_base, messages=USER + [{"role": "assistant", "content": None}]))


# ---- every stated limit: one over is 400 naming it, at the limit is served --------------------------------
def _grammar(size: int) -> str:
    head = 'root ::= "t1"'
    return head + " " * (size - len(head))


def _schema_of_bytes(size: int) -> dict[str, Any]:
    return {"type": "string", "description": "d" * size}


CASES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("max_messages", {"messages": USER * 4}, {"messages": USER * 5}, "messages"),
    ("max_stop", {"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}, "stop"),
    ("max_stop_chars", {"stop": "x" * 8}, {"stop": "x" * 9}, "stop"),
    ("max_total_tokens", {"max_tokens": 20, "n": 2}, {"max_tokens": 21, "n": 2}, "max_tokens"),
    ("max_logit_bias", {"logit_bias": {"1": 1, "2": 1, "3": 1}}, {"logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}},
     "logit_bias"),
    ("max_tools", {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2)],
                   "tool_choice": "none"},
     {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3)], "tool_choice": "none"},
     "tools"),
    ("max_schema_depth", {"response_format": schema_format(nested_schema(4))},
     {"response_format": schema_format(nested_schema(5))}, "response_format"),
    ("max_enum", {"response_format": schema_format({"enum": ["a", "b", "c", "d", "e"]})},
     {"response_format": schema_format({"enum": ["a", "b", "c", "d", "e", "f"]})}, "response_format"),
    ("max_pattern_chars", {"response_format": schema_format({"type": "string", "pattern": "a" * 20})},
     {"response_format": schema_format({"type": "string", "pattern": "a" * 21})}, "response_format"),
    ("max_pattern_chars", {"response_format": {"type": "regex", "regex": "t1" * 10}},
     {"response_format": {"type": "regex", "regex": "t1" * 10 + "x"}}, "response_format"),
    ("max_grammar_bytes", {"response_format": {"type": "grammar", "grammar": _grammar(100)}},
     {"response_format": {"type": "grammar", "grammar": _grammar(101)}}, "response_format"),
    ("max_schema_bytes", {"response_format": schema_format(_schema_of_bytes(1500))},
     {"response_format": schema_format(_schema_of_bytes(2000))}, "response_format"),
]


@pytest.mark.parametrize("limit,at,beyond,param", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_limit(small_base: str, limit: str, at: dict[str, Any], beyond: dict[str, Any], param: str) -> None:
    r = post(small_base, **at)
    assert r.status_code == 200 or r.json()["error"]["code"] != "limit_exceeded", r.text
    assert r.status_code < 500, r.text
    error = error_of(post(small_base, **beyond))
    assert error["code"] == "limit_exceeded" and error["param"] == param, error
    assert limit in error["message"] and "--" + limit.replace("_", "-") in error["message"]


def test_tool_parameters_count_as_schemas(small_base: str) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": nested_schema(6)}}
    error = error_of(post(small_base, tools=[tool], tool_choice="required"))
    assert error["code"] == "limit_exceeded" and error["param"] == "tools" and "max_schema_depth" in error["message"]


def test_completion_prompts_and_total_tokens(small_base: str) -> None:
    path = "/v1/completions"
    assert post(small_base, path, prompt=["t1"] * 3, max_tokens=2).status_code == 200
    error = error_of(post(small_base, path, prompt=["t1"] * 4, max_tokens=2))
    assert error["code"] == "limit_exceeded" and "max_prompts" in error["message"]
    error = error_of(post(small_base, path, prompt=["t1"] * 3, max_tokens=7, n=2))  # 7 x 2 x 3 = 42 > 40
    assert error["code"] == "limit_exceeded" and "max_total_tokens" in error["message"]


def test_default_max_tokens_counts_toward_the_total(small_base: str, tiny: Any) -> None:
    """Without max_tokens a chat request asks for the artifact's default (over 40 here) per choice."""
    assert tiny.config.sampling.max_tokens > SMALL.max_total_tokens
    error = error_of(post(small_base, max_tokens=None))
    assert error["code"] == "limit_exceeded" and "max_total_tokens" in error["message"]


def test_body_over_the_limit_is_413(small_base: str) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 40_000}]})
    r = httpx.post(small_base + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert error_of(r, 413)["code"] == "request_too_large"
    assert httpx.get(small_base + "/health", timeout=10).status_code == 200


def test_serve_flags_set_every_limit() -> None:
    parser = argparse.ArgumentParser()
    add_limit_args(parser)
    assert limits_from_args(parser.parse_args([])) == Limits()
    limits = limits_from_args(parser.parse_args(["--max-messages", "7", "--max-schema-depth", "9"]))
    assert limits.max_messages == 7 and limits.max_schema_depth == 9
    with pytest.raises(EdgeLLMError, match="--max-enum must be at least 1"):
        limits_from_args(parser.parse_args(["--max-enum", "0"]))


def test_every_limit_is_documented() -> None:
    text = (Path(__file__).parents[2] / "docs" / "server.md").read_text(encoding="utf-8")
    for name, value in vars(Limits()).items():
        row = next((line for line in text.splitlines() if f"`--{name.replace('_', '-')}" in line), None)
        assert row is not None, f"docs/server.md has no row for --{name.replace('_', '-')}"
        assert f"`{value}`" in row, f"the row for {name} does not show its default {value}: {row}"


# ---- found by the fuzz suite (tests/fuzz) ---------------------------------------------------------------------
def test_top_logprobs_of_a_constrained_step_are_finite(default_base: str) -> None:
    """top_logprobs under a grammar listed forbidden tokens with logprob -inf, which JSON cannot carry: a 500."""
    r = client(default_base).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, temperature=0, logprobs=True, top_logprobs=5,
        response_format={"type": "json_object"})
    content = r.choices[0].logprobs.content
    assert content and content[0].token == "{"
    for item in content:
        assert all(top.logprob > float("-inf") for top in item.top_logprobs)
    assert len(content[0].top_logprobs) == 1  # only "{" can start a JSON object
