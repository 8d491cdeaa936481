"""Through the three surfaces (Python stream, `edgellm run`, the server with the openai client): a reply cut
inside a multi-byte character never shows U+FFFD; two identical greedy requests give the same text whatever the
prefix cache holds; the loop guard is configurable and reported."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from edgellm.generation import GenerationParams
from edgellm.response_format import ResponseFormat
from tests.cli.test_cli import edgellm

openai = pytest.importorskip("openai")
from tests.serve.test_serve_api import MODEL, engine, running_server, wait_ready  # noqa: E402, F401

CHAR = "龘"  # three byte-level tokens in SmolLM2's vocabulary: any cut inside it leaves a partial character
REGEX = {"type": "regex", "regex": CHAR * 3}


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[Any]:
    with running_server(lambda: engine, max_queue=4) as url:
        wait_ready(url)
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _cut_lengths(engine: Any) -> list[int]:
    """max_tokens values that end the forced reply inside a character (checked on the token ids, not assumed)."""
    ids = engine.generate("x", GenerationParams(max_tokens=9, temperature=0.0, response_format=ResponseFormat(
        "regex", regex=CHAR * 3))).token_ids
    cuts = [n for n in range(1, len(ids)) if engine.tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert cuts, "the forced reply never ends inside a character"
    return cuts


def test_python_stream_drops_a_cut_character(engine: Any) -> None:
    for n in _cut_lengths(engine):
        params = GenerationParams(max_tokens=n, temperature=0.0, response_format=ResponseFormat("regex",
                                                                                                regex=CHAR * 3))
        chunks = list(engine.stream("x", params))
        text = "".join(c.text for c in chunks)
        ids = [i for c in chunks for i in c.token_ids]
        assert engine.tokenizer.decode(ids).endswith("\ufffd")  # the cut really is inside a character
        assert "\ufffd" not in text and chunks[-1].finish_reason == "length"
        assert text == engine.tokenizer.decode(ids).rstrip("\ufffd") and set(text) <= {CHAR}


def test_cli_run_drops_a_cut_character(engine: Any) -> None:
    for n in _cut_lengths(engine)[:2]:
        proc = edgellm("run", MODEL, "x", "--raw", "--regex", CHAR * 3, "-n", str(n), "--quiet")
        assert proc.returncode == 3, proc.stderr  # incomplete under the regex
        assert "\ufffd" not in proc.stdout and set(proc.stdout.strip()) <= {CHAR}


def test_server_drops_a_cut_character_streamed_or_not(engine: Any, client: Any) -> None:
    for n in _cut_lengths(engine):
        whole = client.completions.create(model=MODEL, prompt="x", max_tokens=n, temperature=0,
                                          extra_body={"response_format": REGEX})
        assert "\ufffd" not in whole.choices[0].text and whole.choices[0].finish_reason == "length"
        assert set(whole.choices[0].text) <= {CHAR}
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="x", max_tokens=n, temperature=0, stream=True,
            extra_body={"response_format": REGEX}) if c.choices)
        assert streamed == whole.choices[0].text


SYSTEM = ("You are a careful assistant for a hardware shop. " * 60).strip()  # > one 512-token prefill chunk


def _chat(client: Any, messages: list[dict[str, str]]) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)


def test_greedy_is_greedy_whatever_the_prefix_cache_holds(client: Any) -> None:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell hammers?"}]
    reply = _chat(client, first).choices[0].message.content
    follow = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And nails?"}]
    warm = _chat(client, follow)  # the cache holds the first turn: whole prefill chunks of it are reused
    assert warm.usage.prompt_tokens_details.cached_tokens >= 512
    _chat(client, [{"role": "user", "content": "Something else entirely."}])
    cold = _chat(client, follow)  # the cache holds an unrelated prompt: only the chat template's opening is shared
    assert cold.usage.prompt_tokens_details.cached_tokens < 16
    assert warm.choices[0].message.content == cold.choices[0].message.content
    again = _chat(client, follow)  # the whole prompt is cached this time (its own decode steps are not reused)
    assert again.choices[0].message.content == cold.choices[0].message.content


def test_loop_guard_is_configurable_and_reported(client: Any, engine: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    person = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    # A name that invites a loop: SmolLM2 repeats "la" until the guard steps in (2 interventions on AVX-512 VNNI)
    messages = [{"role": "user", "content": "Write the name 'lalalalalalalalalalala' as JSON with age 3"}]
    on = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                        response_format=person)
    off = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                         extra_body={"response_format": {**person, "loop_guard": False}})
    direct = engine.chat(messages, GenerationParams(max_tokens=60, temperature=0.0,
                                                    response_format=ResponseFormat("json_schema", schema)))
    reported = on.usage.model_extra["guard_interventions"]
    assert reported == direct.stats.guard_interventions and on.choices[0].message.content == direct.text
    assert off.usage.model_extra["guard_interventions"] == 0
    assert (on.choices[0].message.content == off.choices[0].message.content) == (reported == 0)
    with pytest.raises(openai.BadRequestError, match="loop_guard"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                       extra_body={"response_format": {**person, "loop_guard": "yes"}})
    with pytest.raises(openai.BadRequestError, match="min_repeats"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                       extra_body={"response_format": {**person, "loop_guard": {"min_repeats": 1}}})
