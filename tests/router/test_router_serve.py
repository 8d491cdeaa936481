"""Hybrid routing end to end: a local server with a policy, a second real `edgellm serve` process as the remote.

Small stubs stand in for the remote only where a real server cannot produce the failure: one that hangs, one
that refuses `json_schema`. Every request goes through the official `openai` client.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from edgellm.router.client import HybridClient, RoutingError  # noqa: E402
from edgellm.resolve import resolve_model  # noqa: E402
from edgellm.router.policy import parse_policy  # noqa: E402
from edgellm.runtime.engine import Engine  # noqa: E402
from edgellm.serve.soak import wait_healthy  # noqa: E402
from tests.serve.test_serve_api import MODEL, running_server, wait_ready  # noqa: E402

LONG = "Summarize: " + "The quick brown fox jumps over the lazy dog. " * 12  # > 100 prompt tokens
SHORT = [{"role": "user", "content": "Say hi."}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def remote_base() -> Iterator[str]:
    """A second, real edgellm server process on loopback: the "cloud"."""
    resolve_model(MODEL, progress=False)  # compile once here, not in two processes at a time
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgellm", "serve", MODEL, "--port", str(port), "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 600, proc)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class _Stub(BaseHTTPRequestHandler):
    """mode "hang": accept and never answer (bounded); mode "no-schema": refuse json_schema as some APIs do."""

    mode = "hang"
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        type(self).seen.append(body)
        if self.mode == "hang":
            time.sleep(20)
            return
        payload = json.dumps({"error": {"message": "response_format json_schema is not supported",
                                        "type": "invalid_request_error", "param": "response_format"}}).encode()
        self.send_response(400)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


def stub(mode: str) -> tuple[str, ThreadingHTTPServer]:
    handler = type(f"Stub_{mode}", (_Stub,), {"mode": mode, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1", server


def make_policy(remote_url: str, **extra: Any) -> Any:
    """A policy with one remote; its 30 s timeout leaves room for a real model on a loaded machine (the hanging
    remote test sets its own)."""
    raw = {"remote": [{"name": "cloud", "base_url": remote_url, "model": MODEL, "timeout_s": 30,
                       **extra.pop("remote", {})}], **extra}
    return parse_policy(raw)


def loader():
    return Engine.load(MODEL, threads=1, progress=False)


def client(base: str) -> Any:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)


def raw_chat(base: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client(base).chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                                  temperature=0, **kw)


def remote_requests(remote_base: str) -> int:
    text = httpx.get(remote_base + "/metrics").text
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith('edgellm_requests_total{endpoint="/v1/chat/completions"'))


RULES = {"rule": [{"name": "long prompts", "route": "cloud", "prompt_tokens_over": 100},
                  {"name": "summaries", "route": "cloud", "task": "summarize"}]}


@pytest.fixture(scope="module")
def routed(remote_base: str) -> Iterator[str]:
    with running_server(loader, policy=make_policy(remote_base + "/v1", **RULES)) as base:
        wait_ready(base)
        yield base


def test_short_requests_stay_local(routed: str, remote_base: str):
    before = remote_requests(remote_base)
    raw = raw_chat(routed, SHORT)
    assert raw.headers["X-Edgellm-Route"] == "local"
    body = json.loads(raw.text)
    assert body["edgellm"] == {"route": "local", "reason": "default", "fallback": None}
    assert body["choices"][0]["message"]["content"]
    assert remote_requests(remote_base) == before


def test_long_prompt_rule_goes_remote(routed: str, remote_base: str):
    before = remote_requests(remote_base)
    raw = raw_chat(routed, [{"role": "user", "content": LONG}])
    assert raw.headers["X-Edgellm-Route"] == "remote:cloud"
    assert json.loads(raw.text)["edgellm"]["reason"] == "long prompts"
    assert raw.parse().choices[0].message.content
    assert remote_requests(remote_base) == before + 1


def test_task_rule_and_privacy_override(routed: str, remote_base: str):
    raw = raw_chat(routed, SHORT, extra_headers={"X-Edgellm-Task": "summarize"})
    assert raw.headers["X-Edgellm-Route"] == "remote:cloud"
    before = remote_requests(remote_base)
    raw = raw_chat(routed, [{"role": "user", "content": LONG}],
                   extra_headers={"X-Edgellm-Task": "summarize", "X-Edgellm-Privacy": "local"})
    assert raw.headers["X-Edgellm-Route"] == "local"
    assert json.loads(raw.text)["edgellm"]["reason"] == "privacy"
    assert remote_requests(remote_base) == before  # the private request never left
    raw = raw_chat(routed, SHORT, extra_body={"metadata": {"task": "summarize", "privacy": "local"}})
    assert raw.headers["X-Edgellm-Route"] == "local"


def test_streaming_through_the_remote(routed: str):
    stream = client(routed).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finals = [c for c in chunks if c.usage is not None or (c.choices and c.choices[0].finish_reason)]
    assert finals and all(c.model_extra["edgellm"]["route"] == "remote:cloud" for c in finals)
    assert chunks[-1].usage.completion_tokens >= 1


def test_local_stream_is_marked_too(routed: str):
    with client(routed).chat.completions.with_streaming_response.create(
            model=MODEL, messages=SHORT, max_tokens=4, temperature=0, stream=True) as response:
        assert response.headers["X-Edgellm-Route"] == "local"
        chunks = list(response.parse())
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert last[0].model_extra["edgellm"]["route"] == "local"


def test_metrics_count_routes(routed: str):
    raw_chat(routed, SHORT)
    text = httpx.get(routed + "/metrics").text
    assert 'edgellm_routes_total{reason="default",target="local"}' in text
    assert 'edgellm_routes_total{reason="long prompts",target="cloud"}' in text


def test_remote_down_falls_back_to_local_or_errors():
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with running_server(loader, policy=make_policy(dead, default="cloud")) as base:
        wait_ready(base)
        raw = raw_chat(base, SHORT)
        assert raw.headers["X-Edgellm-Route"] == "local"
        assert json.loads(raw.text)["edgellm"]["fallback"] == "remote_error"
        assert 'edgellm_route_fallbacks_total{source="cloud",target="local",why="remote_error"} 1' in \
            httpx.get(base + "/metrics").text
    with running_server(loader, policy=make_policy(dead, default="cloud", fallback={"remote_error": "error"})) as base:
        wait_ready(base)
        with pytest.raises(openai.APIStatusError) as info:
            raw_chat(base, SHORT)
        assert info.value.status_code == 502 and "remote 'cloud': unreachable" in info.value.message


def test_a_hanging_remote_is_bounded_then_local():
    url, server = stub("hang")
    try:
        with running_server(loader, policy=make_policy(url, default="cloud", remote={"timeout_s": 1})) as base:
            wait_ready(base)
            t0 = time.monotonic()
            raw = raw_chat(base, SHORT)
            assert time.monotonic() - t0 < 15
            assert raw.headers["X-Edgellm-Route"] == "local"
            assert json.loads(raw.text)["edgellm"]["fallback"] == "remote_error"
    finally:
        server.shutdown()


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}


def test_remote_refusing_json_schema_falls_back_to_local_constrained_decoding():
    url, server = stub("no-schema")
    try:
        with running_server(loader, policy=make_policy(url, default="cloud")) as base:
            wait_ready(base)
            fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}
            raw = raw_chat(base, SHORT, response_format=fmt)
            body = json.loads(raw.text)
            assert body["edgellm"] == {"route": "local", "reason": "default", "fallback": "remote_rejects_schema"}
            if body["choices"][0]["finish_reason"] == "stop":
                jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMA)
            forwarded = server.RequestHandlerClass.seen[-1]
            assert forwarded["model"] == MODEL and forwarded["response_format"] == fmt  # passed through unchanged
    finally:
        server.shutdown()


def test_local_failure_goes_remote_and_both_failing_names_both(remote_base: str):
    def broken():
        raise RuntimeError("out of memory while loading")

    with running_server(broken, policy=make_policy(remote_base + "/v1", fallback={"local_error": "cloud"})) as base:
        time.sleep(0.5)
        raw = raw_chat(base, SHORT)
        assert raw.headers["X-Edgellm-Route"] == "remote:cloud"
        assert json.loads(raw.text)["edgellm"]["fallback"] == "local_error"
        with pytest.raises(openai.APIStatusError) as info:  # a private request may not fall back
            raw_chat(base, SHORT, extra_headers={"X-Edgellm-Privacy": "local"})
        assert info.value.status_code == 503
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with running_server(broken, policy=make_policy(dead, fallback={"local_error": "cloud"})) as base:
        time.sleep(0.5)
        with pytest.raises(openai.APIStatusError) as info:
            raw_chat(base, SHORT)
        assert info.value.status_code == 502
        assert "out of memory while loading" in info.value.message and "remote 'cloud'" in info.value.message


def test_local_timeout_goes_remote(remote_base: str):
    policy = make_policy(remote_base + "/v1",
                         fallback={"local_timeout": "cloud", "local_timeout_s": 0.001})
    with running_server(loader, policy=policy) as base:
        wait_ready(base)
        raw = raw_chat(base, SHORT)
        assert raw.headers["X-Edgellm-Route"] == "remote:cloud"
        assert json.loads(raw.text)["edgellm"]["fallback"] == "local_timeout"
        stream = client(base).chat.completions.create(model=MODEL, messages=SHORT, max_tokens=4, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert httpx.get(base + "/health").status_code == 200  # the abandoned local job freed the engine


def test_python_api_routes_the_same_way(remote_base: str):
    engine = loader()
    try:
        hybrid = HybridClient(make_policy(remote_base + "/v1", **RULES), engine)
        assert hybrid.chat(SHORT, max_tokens=4).route == "local"
        reply = hybrid.chat([{"role": "user", "content": LONG}], max_tokens=4)
        assert (reply.route, reply.reason) == ("remote:cloud", "long prompts") and reply.text
        assert hybrid.chat([{"role": "user", "content": LONG}], max_tokens=4, private=True).route == "local"
        dead = HybridClient(make_policy(f"http://127.0.0.1:{free_port()}/v1", default="cloud"), engine)
        reply = dead.chat(SHORT, max_tokens=4)
        assert (reply.route, reply.fallback) == ("local", "remote_error")
        strict = HybridClient(make_policy(f"http://127.0.0.1:{free_port()}/v1", default="cloud",
                                          fallback={"remote_error": "error"}), engine)
        with pytest.raises(RoutingError, match="allows no fallback"):
            strict.chat(SHORT, max_tokens=4)
    finally:
        engine.close()


def test_cli_refuses_a_bad_policy_in_one_line(tmp_path: Path):
    bad = tmp_path / "route.toml"
    bad.write_text('[[rule]]\nroute = "moon"\n')
    out = subprocess.run([sys.executable, "-m", "edgellm", "serve", MODEL, "--route", str(bad), "--port",
                          str(free_port())], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [f"edgellm: error: routing policy {bad}: rule 1: route 'moon' is "
                                               "neither 'local' nor a remote (local)"]
