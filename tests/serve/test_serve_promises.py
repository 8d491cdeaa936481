"""Server promises from README.md and docs/server.md, each checked with the official `openai` client against a
real server: `tool_choice: "auto"`, refused `/v1/completions` fields, `response_format` on `/v1/completions`,
`LengthFinishReasonError` from `parse()`, the `developer` role, and an artifact folder as the model id."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel  # noqa: E402

from tests.serve.test_serve_api import (MODEL, USER, WEATHER, TIME, base, client, engine,  # noqa: E402,F401
                                  running_server, wait_ready)

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}


def forced_text(text: str) -> dict[str, Any]:
    """A regex response_format with exactly one sentence: the model can only write `text`."""
    literal = "".join("\\n" if ch == "\n" else "\\" + ch if ch in "\\^$.|?*+()[]{}/" else ch for ch in text)
    return {"type": "regex", "regex": literal}


def auto(client: Any, reply: str, **kw: Any) -> Any:  # noqa: F811
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER, TIME],
        tool_choice="auto", max_tokens=120, temperature=0, extra_body={"response_format": forced_text(reply)}, **kw)


@pytest.mark.parametrize("reply", [
    json.dumps(CALL),
    f"Sure. <tool_call>{json.dumps(CALL)}</tool_call>",
    f"Calling it:\n```json\n{json.dumps(CALL)}\n```",
])
def test_auto_turns_a_tool_call_reply_into_tool_calls(client: Any, reply: str) -> None:  # noqa: F811
    choice = auto(client, reply).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL["arguments"]


@pytest.mark.parametrize("reply", [
    "It is sunny in Paris.",
    json.dumps({"name": "get_stock_price", "arguments": {"ticker": "X"}}),  # a tool nobody offered
    json.dumps({"name": "get_weather", "arguments": "Paris"}),  # arguments that are not an object
])
def test_auto_keeps_other_replies_as_content(client: Any, reply: str) -> None:  # noqa: F811
    choice = auto(client, reply).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == reply


def test_auto_streamed_sends_one_tool_calls_delta(client: Any) -> None:  # noqa: F811
    chunks = list(auto(client, json.dumps(CALL), stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == CALL["arguments"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_auto_unconstrained_reply_has_the_documented_shape(client: Any) -> None:  # noqa: F811
    """Without a constraint the 135M model may or may not call: either way the reply is well formed."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       tools=[WEATHER], tool_choice="auto", max_tokens=40, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert all(c.function.name == "get_weather" and isinstance(json.loads(c.function.arguments), dict)
                   for c in choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)


@pytest.mark.parametrize("field,value", [("suffix", "tail"), ("best_of", 2), ("echo", True)])
def test_unsupported_completion_fields_are_400_naming_the_field(client: Any, field: str, value: Any) -> None:  # noqa: F811
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2, **{field: value})
    error = info.value.body
    assert error["param"] == field and field in error["message"] and error["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="Once", max_tokens=1, best_of=1).choices  # 1 = the default


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_on_plain_completions(client: Any) -> None:  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=200, temperature=0,
                                  extra_body={"response_format": fmt})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["complete"] is True
    jsonschema.validate(json.loads(choice.text), PERSON)
    cut = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=3, temperature=0,
                                    extra_body={"response_format": fmt})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].model_extra["complete"] is False


class Person(BaseModel):
    name: str
    age: int


def test_parse_raises_length_finish_reason_error_on_a_cut_reply(client: Any) -> None:  # noqa: F811
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    with pytest.raises(openai.LengthFinishReasonError) as info:
        client.chat.completions.parse(model=MODEL, messages=ask, response_format=Person, max_tokens=4,
                                      temperature=0)
    choice = info.value.completion.choices[0]
    assert choice.finish_reason == "length" and choice.model_extra["complete"] is False
    assert info.value.completion.usage.completion_tokens == 4


def test_developer_role_is_a_system_message(client: Any) -> None:  # noqa: F811
    def ask(role: str) -> Any:
        return client.chat.completions.create(
            model=MODEL, max_tokens=12, temperature=0, seed=5,
            messages=[{"role": role, "content": "Answer in French."}, *USER])

    developer, system = ask("developer"), ask("system")
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert developer.choices[0].message.content == system.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, seed=5, messages=USER)
    assert plain.usage.prompt_tokens != developer.usage.prompt_tokens  # the message was not dropped


@pytest.fixture(scope="module")
def by_path(engine: Any) -> Iterator[tuple[str, str]]:  # noqa: F811
    """A server started, as `edgellm serve /path/to/artifact` starts one, under the artifact folder's path."""
    path = str(engine.artifact.folder)
    with running_server(lambda: engine, model_name=path) as url:
        wait_ready(url)
        yield url, path


def test_artifact_folder_as_model_id(by_path: tuple[str, str], engine: Any) -> None:  # noqa: F811
    url, path = by_path
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == [path]
    for name in (path, engine.artifact.folder.name):  # the path, or the folder's name
        r = client.chat.completions.create(model=name, messages=USER, max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
