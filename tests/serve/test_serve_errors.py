"""Bad requests, overload, disconnects and timeouts: OpenAI error bodies with the right status, and a server that
keeps serving; /metrics as Prometheus text whose counters move."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.serve.test_serve_api import MODEL, USER, engine, running_server, wait_ready  # noqa: E402,F401

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def base(engine: Any) -> Iterator[str]:  # noqa: F811
    with running_server(lambda: engine, max_queue=4, max_body_bytes=64 * 1024) as url:
        wait_ready(url)
        yield url


def chat(base: str, **body: Any) -> httpx.Response:
    return httpx.post(base + CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 4, **body}, timeout=120)


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def long_generation(eos: int) -> dict[str, Any]:
    """A request that would run for thousands of tokens: EOS is banned."""
    return {"model": MODEL, "messages": USER, "max_tokens": 4000, "logit_bias": {str(eos): -100}, "stream": True}


def metric(base: str, name: str, **labels: str) -> float:
    values = parse_prometheus(httpx.get(base + "/metrics", timeout=30).text)
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (-?[0-9.e+-]+|\+Inf|-Inf|NaN)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A strict parser for the text exposition format: every line is a comment or a well-formed sample."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
            continue
        if line.startswith("# HELP ") or not line:
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample: {line!r}"
        name, labels, value = m.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"sample {name} has no # TYPE"
        key = (name, tuple(sorted(_LABEL.findall(labels or ""))))
        assert key not in out, f"duplicate sample {line!r}"
        out[key] = float(value)
    return out


def test_malformed_json_and_wrong_types(base: str) -> None:
    r = httpx.post(base + CHAT, content=b'{"model": "x", "messages": [', headers={"Content-Type": "application/json"})
    assert_error(r, 400, code="invalid_json")
    assert_error(httpx.post(base + CHAT, content=b"[1, 2]", headers={"Content-Type": "application/json"}), 400)
    assert_error(chat(base, messages="hello"), 400, param="messages")
    assert_error(chat(base, temperature="hot"), 400, param="temperature")
    assert_error(chat(base, max_tokens=0), 400, param="max_tokens")
    assert_error(chat(base, n=100), 400, param="n")
    assert_error(chat(base, messages=[{"role": "wizard", "content": "hi"}]), 400, param="messages.0.role")
    assert_error(chat(base, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400)
    assert_error(chat(base, logit_bias={"abc": 1}), 400, param="logit_bias")
    assert_error(chat(base, logit_bias={"99999999": 1}), 400, param="logit_bias")
    assert_error(chat(base, top_logprobs=2), 400, param="top_logprobs")
    assert_error(chat(base, tool_choice="required"), 400, param="tool_choice")
    assert_error(httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True}), 400)
    assert_error(httpx.get(base + "/v1/nothing-here"), 404)


def test_unknown_model_is_404_through_the_client(base: str) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    assert_error(httpx.get(base + "/v1/models/gpt-4o"), 404, param="model")


def test_prompt_over_the_context_window(base: str, engine: Any) -> None:  # noqa: F811
    window = engine.context_window
    error = assert_error(chat(base, messages=[{"role": "user", "content": "hello " * window}]), 400,
                         param="messages", code="context_length_exceeded")
    numbers = [int(n) for n in re.findall(r"\d+", error["message"])]
    assert window in numbers and any(n > window for n in numbers)
    assert_error(chat(base, messages=[{"role": "user", "content": "hello " * window}], stream=True), 400,
                 code="context_length_exceeded")  # a stream fails before it starts, with the same status


def test_body_over_the_cap_is_413(base: str) -> None:
    assert_error(chat(base, messages=[{"role": "user", "content": "x" * 100_000}]), 413, code="request_too_large")

    def chunked() -> Iterator[bytes]:  # no Content-Length: the cap is counted while the body is read
        yield b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}]}'

    r = httpx.post(base + CHAT, content=chunked(), headers={"Content-Type": "application/json"}, timeout=60)
    assert_error(r, 413, code="request_too_large")
    assert chat(base, max_tokens=1).status_code == 200


def test_invalid_and_unsupported_schemas(base: str) -> None:
    assert_error(chat(base, response_format={"type": "json_schema"}), 400, param="response_format")
    assert_error(chat(base, response_format={"type": "xml"}), 400, param="response_format")
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "uniqueItems": True}
    error = assert_error(chat(base, response_format={"type": "json_schema",
                                                     "json_schema": {"name": "s", "schema": schema}}), 400,
                         param="response_format")
    assert "uniqueItems" in error["message"]
    tool = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": schema}, "required": ["tags"]}}}
    error = assert_error(chat(base, tools=[tool], tool_choice="required"), 400, param="tools")
    assert "uniqueItems" in error["message"]


def test_api_key(engine: Any) -> None:  # noqa: F811
    with running_server(lambda: engine, api_key="s3cret") as url:
        wait_ready(url)
        assert_error(httpx.get(url + "/v1/models"), 401, code="invalid_api_key")
        assert_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list()] == [MODEL]
        assert httpx.get(url + "/health").status_code == 200


def test_health_is_503_while_loading(engine: Any) -> None:  # noqa: F811
    release = threading.Event()

    def slow_loader() -> Any:
        release.wait(60)
        return engine

    with running_server(slow_loader) as url:
        assert httpx.get(url + "/health").status_code == 503
        assert_error(httpx.post(url + CHAT, json={"model": MODEL, "messages": USER}), 503, code="model_not_ready")
        release.set()
        wait_ready(url)


class _BrokenEngine:
    """The real engine, except that generating fails with an unexpected error that quotes the prompt."""

    def __init__(self, engine: Any) -> None:  # noqa: F811
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stream_on(self, session: Any, prompt: Any, params: Any) -> Iterator[Any]:
        raise RuntimeError(f"boom while reading {self._engine.tokenizer.decode(prompt)!r}")


def test_unexpected_errors_are_500_without_content(engine: Any) -> None:  # noqa: F811
    with running_server(lambda: _BrokenEngine(engine)) as url:
        wait_ready(url)
        for stream in (False, True):
            r = httpx.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hush-hush"}],
                                             "stream": stream}, timeout=60)
            error = assert_error(r, 500, code="internal_error")
            assert "hush" not in r.text and "boom" not in error["message"]
        assert httpx.get(url + "/health").status_code == 200
        assert metric(url, "edgellm_requests_total", endpoint=CHAT, status="500") == 2


class _HeldEngine:
    """The real engine, except that each generation waits for `release` before its first token: while it waits,
    the worker is busy and requests pile up in the queue, so queue behaviour is tested without racing."""

    def __init__(self, engine: Any) -> None:  # noqa: F811
        self._engine = engine
        self.release = threading.Event()
        self.entered = threading.Event()
        self.streams = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stream_on(self, session: Any, prompt: Any, params: Any) -> Iterator[Any]:
        self.streams += 1
        self.entered.set()
        assert self.release.wait(120), "the test never released the engine"
        yield from self._engine.stream_on(session, prompt, params)


def wait_for(condition: Any, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_full_queue_is_429_with_retry_after_and_queued_requests_are_served(engine: Any) -> None:  # noqa: F811
    held = _HeldEngine(engine)
    with running_server(lambda: held, max_queue=4) as url, ThreadPoolExecutor(5) as pool:
        wait_ready(url)
        running = pool.submit(chat, url, max_tokens=4, seed=0)
        try:
            assert held.entered.wait(60)  # the worker now holds the first request
            queued = [pool.submit(chat, url, max_tokens=4, seed=i) for i in range(1, 5)]
            wait_for(lambda: metric(url, "edgellm_queue_depth") == 4, "the four requests never reached the queue")
            for stream in (False, True):
                r = chat(url, max_tokens=4, stream=stream)
                assert int(r.headers["Retry-After"]) >= 1
                assert_error(r, 429, code="queue_full")
        finally:  # a failure above must not leave the pool waiting 120 s on the held requests
            held.release.set()
        for r in [running.result(), *(f.result() for f in queued)]:
            body = r.json()
            assert r.status_code == 200, body
            assert body["choices"][0]["message"]["content"] and 1 <= body["usage"]["completion_tokens"] <= 4
        assert held.streams == 5
        assert metric(url, "edgellm_requests_total", endpoint=CHAT, status="429") == 2
        assert chat(url, max_tokens=1).status_code == 200


def test_time_in_the_queue_counts_toward_the_timeout(engine: Any) -> None:  # noqa: F811
    held = _HeldEngine(engine)
    with running_server(lambda: held, timeout_s=1.0) as url, ThreadPoolExecutor(2) as pool:
        wait_ready(url)
        running = pool.submit(chat, url, max_tokens=1)
        assert held.entered.wait(60)
        queued = pool.submit(chat, url, max_tokens=1)
        wait_for(lambda: metric(url, "edgellm_queue_depth") == 1, "the second request never reached the queue")
        time.sleep(1.2)  # the queued request's whole timeout passes while it waits
        held.release.set()
        running.result()  # held past its own timeout too: 200 or 408 depending on where the check falls
        assert_error(queued.result(), 408, code="timeout")
        assert held.streams == 1  # the timed-out request never reached the engine


def test_a_queued_request_whose_client_left_is_dropped(engine: Any) -> None:  # noqa: F811
    held = _HeldEngine(engine)
    with running_server(lambda: held) as url, ThreadPoolExecutor(1) as pool:
        wait_ready(url)
        running = pool.submit(chat, url, max_tokens=2)
        assert held.entered.wait(60)
        for stream in (False, True):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(url + CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 2, "stream": stream},
                           timeout=0.5)
        wait_for(lambda: metric(url, "edgellm_requests_total", endpoint=CHAT, status="499") == 2,
                 "the server never noticed that the queued clients left")
        held.release.set()
        assert running.result().status_code == 200
        assert chat(url, max_tokens=1).status_code == 200  # served after the dropped ones in the queue
        assert held.streams == 2  # the first and the last: the two dropped requests never reached the engine


def _engine_freed_before_the_end(base: str, completion_tokens_before: float) -> None:
    """The engine stops for a client that left: no request is running, and the abandoned one was cut short rather
    than run to its 4000 tokens (a finished generation adds its tokens to the counter; an abandoned one adds none) -
    not judged by how fast it went, which a quick machine could meet without cancelling anything."""
    deadline = time.monotonic() + 60
    while metric(base, "edgellm_requests_running") != 0:
        assert time.monotonic() < deadline, "the engine is still generating for a client that left"
        time.sleep(0.05)
    generated = metric(base, "edgellm_completion_tokens_total") - completion_tokens_before
    assert generated < 4000, f"the abandoned request ran to its end ({generated:.0f} tokens)"


def test_disconnect_mid_stream_frees_the_engine(base: str, engine: Any) -> None:  # noqa: F811
    eos = engine.config.tokenizer.eos_token_id
    before = metric(base, "edgellm_completion_tokens_total")
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", base + CHAT, json=long_generation(eos)) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())
            assert first.startswith("data: ")
    _engine_freed_before_the_end(base, before)
    r = chat(base, max_tokens=2)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(base + "/health").status_code == 200


def test_client_that_gives_up_on_a_whole_response_frees_the_engine(base: str, engine: Any) -> None:  # noqa: F811
    eos = engine.config.tokenizer.eos_token_id
    before = metric(base, "edgellm_completion_tokens_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + CHAT, json={**long_generation(eos), "stream": False}, timeout=1.5)
    _engine_freed_before_the_end(base, before)
    assert chat(base, max_tokens=2).status_code == 200


def test_request_timeout_is_408_and_frees_the_engine(engine: Any) -> None:  # noqa: F811
    eos = engine.config.tokenizer.eos_token_id
    with running_server(lambda: engine, timeout_s=1.0) as url:
        wait_ready(url)
        body = {**long_generation(eos), "stream": False}
        assert_error(httpx.post(url + CHAT, json=body, timeout=120), 408, code="timeout")
        streamed = httpx.post(url + CHAT, json={**body, "stream": True}, timeout=120)
        assert streamed.status_code == 200 and '"code":"timeout"' in streamed.text  # an error event ends it
        r = httpx.post(url + CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 1}, timeout=120)
        assert r.status_code == 200


def test_metrics_move_as_requests_are_served(base: str) -> None:
    before_ok = metric(base, "edgellm_requests_total", endpoint=CHAT, status="200")
    before_bad = metric(base, "edgellm_requests_total", endpoint=CHAT, status="400")
    before_out = metric(base, "edgellm_completion_tokens_total")
    before_in = metric(base, "edgellm_prompt_tokens_total")
    before_ttft = metric(base, "edgellm_time_to_first_token_seconds_count")
    r = chat(base, max_tokens=3)
    assert r.status_code == 200
    assert_error(chat(base, temperature=-1), 400)
    usage = r.json()["usage"]
    assert metric(base, "edgellm_requests_total", endpoint=CHAT, status="200") == before_ok + 1
    assert metric(base, "edgellm_requests_total", endpoint=CHAT, status="400") == before_bad + 1
    assert metric(base, "edgellm_completion_tokens_total") == before_out + usage["completion_tokens"]
    assert metric(base, "edgellm_prompt_tokens_total") == before_in + usage["prompt_tokens"]
    assert metric(base, "edgellm_time_to_first_token_seconds_count") == before_ttft + 1
    assert metric(base, "edgellm_queue_depth") == 0
    values = parse_prometheus(httpx.get(base + "/metrics").text)
    buckets = [v for (name, labels), v in values.items() if name == "edgellm_decode_tokens_per_second_bucket"]
    assert buckets == sorted(buckets) and buckets[-1] == values[("edgellm_decode_tokens_per_second_count", ())]
    assert httpx.get(base + "/health").status_code == 200
