"""The server against a hostile web page, a slow or greedy client and a leaky remote (issue 29, findings 4, 5, 8,
11, 12), through real loopback servers on a tiny random chat model: foreign Host headers are 421 on every route,
unknown privacy markers are 400 and never reach the remote, no credential appears in any body or log line,
slowloris connections are closed, and odd strings and numbers are 400s naming the field, never 500s."""

from __future__ import annotations

import base64
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

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from edgellm.errors import EdgeLLMError  # noqa: E402
from edgellm.router.decide import MarkerError, request_tags  # noqa: E402
from edgellm.router.policy import PolicyError, Remote, parse_policy  # noqa: E402
from edgellm.router.redact import MASK, redact, remote_secrets  # noqa: E402
from edgellm.serve.hosts import HostAllowList  # noqa: E402
from edgellm.serve.transport import Connections  # noqa: E402
from edgellm.serve.soak import wait_healthy  # noqa: E402
from tests.support.tiny_chat import tiny_chat_engine  # noqa: E402
from tests.serve.test_serve_api import running_server, wait_ready  # noqa: E402

MODEL = "smollm2-135m"  # the name running_server gives the app
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def tiny(tiny_root: Path) -> Any:
    return tiny_chat_engine(tiny_root)


@pytest.fixture(scope="module")
def base(tiny: Any) -> Iterator[str]:
    with running_server(lambda: tiny) as url:
        wait_ready(url)
        yield url


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def assert_one_line_error(r: Any, status: int, code: str | None = None, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert "\n" not in error["message"] and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error["message"]


# ------------------------------------------------------------------------------ finding 4: DNS rebinding


FOREIGN = ["attacker.example", "attacker.example:8000", "localhost.attacker.example", "127.0.0.1.nip.io",
           "0.0.0.0:8000", "[::]:8000", "[::1", "localhost:port"]


@pytest.mark.parametrize("host", FOREIGN)
def test_a_foreign_host_is_421_on_every_route(base: str, host: str) -> None:
    headers = {"host": host}
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                         ("GET", "/"), ("GET", "/health"), ("GET", "/v1/models"), ("GET", "/no/such/route")):
        r = httpx.request(method, base + path, headers=headers, json=CHAT if method == "POST" else None, timeout=30)
        message = assert_one_line_error(r, 421, code="host_not_allowed")
        assert "--allowed-host" in message, message
        assert "edgellm_requests_total" not in r.text and "<html" not in r.text.lower()


def test_loopback_names_are_answered(base: str) -> None:
    port = port_of(base)
    for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}", "[::1]", f"[::1]:{port}",
                 "LOCALHOST", "localhost."):
        assert httpx.get(base + "/health", headers={"host": host}, timeout=30).status_code == 200, host
    r = httpx.post(base + "/v1/chat/completions", headers={"host": f"localhost:{port}"}, json=CHAT, timeout=60)
    assert r.status_code == 200, r.text


def test_allowed_host_adds_names_and_star_answers_any(tiny: Any) -> None:
    hosts = HostAllowList.for_bind("127.0.0.1", ["mybox.lan", "Other.Example:9000"])
    with running_server(lambda: tiny, hosts=hosts) as url:
        wait_ready(url)
        for host in ("mybox.lan", "mybox.lan:8000", "other.example", "localhost"):
            assert httpx.get(url + "/metrics", headers={"host": host}, timeout=30).status_code == 200, host
        assert_one_line_error(httpx.get(url + "/metrics", headers={"host": "attacker.example"}, timeout=30), 421)
    with running_server(lambda: tiny, hosts=HostAllowList.for_bind("127.0.0.1", ["*"])) as url:
        wait_ready(url)
        assert httpx.get(url + "/metrics", headers={"host": "attacker.example"}, timeout=30).status_code == 200


def test_the_allow_list_of_each_bind() -> None:
    loopback = HostAllowList.for_bind("127.0.0.1")
    assert not loopback.allows("192.168.1.5") and not loopback.allows("mybox.lan")
    lan = HostAllowList.for_bind("192.168.1.5")
    assert lan.allows("192.168.1.5:8000") and lan.allows("localhost") and not lan.allows("192.168.1.6")
    named = HostAllowList.for_bind("mybox.lan")
    assert named.allows("MyBox.lan:8000") and not named.allows("evil.lan")
    for wildcard in ("0.0.0.0", "::"):  # any IP address (an address cannot be rebound), no names, never 0.0.0.0
        hosts = HostAllowList.for_bind(wildcard)
        assert hosts.allows("192.168.1.5:8000") and hosts.allows("[fe80::1]:8000") and hosts.allows("localhost")
        assert not hosts.allows("attacker.example") and not hosts.allows("0.0.0.0") and not hosts.allows("[::]")
    for bad in ("a/b", "user@host", "[::1", "host:port", ""):
        with pytest.raises(EdgeLLMError, match="--allowed-host"):
            HostAllowList.for_bind("127.0.0.1", [bad])


# ------------------------------------------------------------------------------ finding 5: privacy markers


class _Remote(BaseHTTPRequestHandler):
    """A stand-in remote: records each request; mode "ok" answers a chat completion, "echo" a 401 whose message
    echoes the request's Authorization header and URL (as some APIs' error pages do)."""

    mode = "ok"
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        auth = self.headers.get("authorization", "")
        type(self).seen.append({"path": self.path, "authorization": auth, "body": body})
        if self.mode == "echo":
            status = 401
            payload = {"error": {"message": f"invalid credentials: Authorization: {auth} for {self.path} "
                                            f"(user {auth[6:] if auth.startswith('Basic') else ''})",
                                 "type": "invalid_request_error", "code": "invalid_api_key"}}
        else:
            status = 200
            payload = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "remote says hi"},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def remote_stub(request: pytest.FixtureRequest) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(port, requests seen) of a stand-in remote on loopback, in the mode a test parametrizes it with."""
    handler = type("Remote", (_Remote,), {"mode": getattr(request, "param", "ok"), "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], handler.seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def routed_to_stub(tiny: Any, remote_stub: tuple[int, list[dict[str, Any]]]) -> Iterator[tuple[str, list[Any]]]:
    """A server whose policy sends everything to the stand-in remote unless it is marked private."""
    port, seen = remote_stub
    policy = parse_policy({"default": "cloud", "remote": [{"name": "cloud", "base_url": f"http://127.0.0.1:{port}/v1",
                                                           "model": "m", "timeout_s": 10}]})
    with running_server(lambda: tiny, policy=policy) as url:
        wait_ready(url)
        yield url, seen


UNKNOWN_PRIVACY = ["local_only", "strict", "yes", "on", "never-remote", "no", "none", "local, public", "",
                   '["local"]']


@pytest.mark.parametrize("value", UNKNOWN_PRIVACY)
def test_an_unknown_privacy_header_is_400_and_nothing_leaves(routed_to_stub: tuple[str, list[Any]],
                                                               value: str) -> None:
    url, seen = routed_to_stub
    r = httpx.post(url + "/v1/chat/completions", headers={"X-Edgellm-Privacy": value}, json=CHAT, timeout=60)
    message = assert_one_line_error(r, 400, code="invalid_routing_marker", param="X-Edgellm-Privacy")
    assert "local, local-only, private, true, 1" in message and "public, false, 0" in message
    assert seen == []


@pytest.mark.parametrize("value", [["local"], {"privacy": "local"}, 1, "local_only", "strict", "yes", "on"])
def test_an_unknown_metadata_privacy_is_400_and_nothing_leaves(routed_to_stub: tuple[str, list[Any]],
                                                                 value: Any) -> None:
    url, seen = routed_to_stub
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "metadata": {"privacy": value}}, timeout=60)
    assert_one_line_error(r, 400, code="invalid_routing_marker", param="metadata.privacy")
    assert seen == []


def test_metadata_and_task_must_have_their_types(routed_to_stub: tuple[str, list[Any]]) -> None:
    url, seen = routed_to_stub
    assert_one_line_error(httpx.post(url + "/v1/chat/completions", json={**CHAT, "metadata": "private"},
                                     timeout=60), 400, param="metadata")
    assert_one_line_error(httpx.post(url + "/v1/chat/completions", json={**CHAT, "metadata": {"task": ["qa"]}},
                                     timeout=60), 400, code="invalid_routing_marker", param="metadata.task")
    twice = httpx.Headers([("X-Edgellm-Task", "qa"), ("X-Edgellm-Task", "summarize")])
    assert_one_line_error(httpx.post(url + "/v1/chat/completions", headers=twice, json=CHAT, timeout=60), 400,
                          code="invalid_routing_marker", param="X-Edgellm-Task")
    assert seen == []


def test_accepted_privacy_values_route_as_they_say(routed_to_stub: tuple[str, list[Any]]) -> None:
    url, seen = routed_to_stub
    for value in ("local", "LOCAL", "local-only", "private", "true", "1"):
        r = httpx.post(url + "/v1/chat/completions", headers={"X-Edgellm-Privacy": value}, json=CHAT, timeout=60)
        assert r.status_code == 200 and r.headers["X-Edgellm-Route"] == "local", (value, r.text)
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "metadata": {"privacy": True}}, timeout=60)
    assert r.headers["X-Edgellm-Route"] == "local"
    # any private marker wins: a repeated header, or a header and the metadata that disagree
    both = httpx.Headers([("X-Edgellm-Privacy", "public"), ("X-Edgellm-Privacy", "local")])
    assert httpx.post(url + "/v1/chat/completions", headers=both, json=CHAT, timeout=60).headers[
        "X-Edgellm-Route"] == "local"
    r = httpx.post(url + "/v1/chat/completions", headers={"X-Edgellm-Privacy": "public"},
                   json={**CHAT, "metadata": {"privacy": "local"}}, timeout=60)
    assert r.headers["X-Edgellm-Route"] == "local"
    assert seen == []
    for value in ("public", "false", "0"):
        r = httpx.post(url + "/v1/chat/completions", headers={"X-Edgellm-Privacy": value}, json=CHAT, timeout=60)
        assert r.status_code == 200 and r.headers["X-Edgellm-Route"] == "remote:cloud", (value, r.text)
    assert len(seen) == 3 and all("metadata" not in s["body"] for s in seen)


def test_an_unknown_privacy_value_is_400_without_a_policy_too(base: str) -> None:
    r = httpx.post(base + "/v1/chat/completions", headers={"X-Edgellm-Privacy": "local_only"}, json=CHAT, timeout=60)
    assert_one_line_error(r, 400, code="invalid_routing_marker")


def test_request_tags_refuse_what_they_do_not_know() -> None:
    for headers, body in (({"X-Edgellm-Privacy": "yes"}, {}), ({}, {"metadata": {"privacy": ["local"]}}),
                          ({}, {"metadata": "junk"}), ({}, {"metadata": {"task": 3}})):
        with pytest.raises(MarkerError):
            request_tags(headers, body)
    assert request_tags({"x-edgellm-privacy": " Private "}, {"metadata": {"privacy": False}}) == (None, True)


# ------------------------------------------------------------------------------ finding 8: credentials

KEY = "sk-test-SECRET-0123456789"
PASSWORD = "s3cr3t-pass"
QUERY_KEY = "QUERYKEY123456"


def secret_forms() -> list[str]:
    return [KEY, PASSWORD, QUERY_KEY, base64.b64encode(f"alice:{PASSWORD}".encode()).decode()]


def leaky_url(port: int) -> str:
    return f"http://alice:{PASSWORD}@127.0.0.1:{port}/v1?api-key={QUERY_KEY}"


def test_redact_masks_every_credential_shape() -> None:
    os.environ["EDGELLM_TEST_REMOTE_KEY"] = KEY
    try:
        remote = Remote("cloud", leaky_url(1), "m", api_key_env="EDGELLM_TEST_REMOTE_KEY")
        secrets = remote_secrets(remote)
    finally:
        del os.environ["EDGELLM_TEST_REMOTE_KEY"]
    basic = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    texts = [leaky_url(1), f"Authorization: Bearer {KEY}", f'{{"authorization": "Basic {basic}"}}', basic,
             f"the key {KEY} is wrong", f"https://u:{PASSWORD}@x/y", f"GET /v1/chat?token={QUERY_KEY}&x=1",
             f'{{"api_key": "{KEY}"}}']
    for text in texts:
        clean = redact(text, secrets)
        assert MASK in clean and not any(s in clean for s in secret_forms()), (text, clean)
    # the shapes alone, with no known secret: a URL's user:pass@, a secret query value, a bearer token
    assert redact("http://bob:hunter22@h/v1?key=abcdef&v=2 Bearer tok-98765") == \
        f"http://{MASK}@h/v1?key={MASK}&v=2 Bearer {MASK}"
    assert redact("a plain message, code invalid_api_key") == "a plain message, code invalid_api_key"


def test_a_bad_base_url_is_refused_without_echoing_it() -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy({"remote": [{"name": "c", "base_url": f"ftp://alice:{PASSWORD}@h/?api-key={QUERY_KEY}",
                                  "model": "m"}]})
    assert PASSWORD not in str(err.value) and QUERY_KEY not in str(err.value)


def leaky_policy(remote_port: int, tmp_path: Path) -> Path:
    path = tmp_path / "route.toml"
    path.write_text(f'default = "cloud"\n[[remote]]\nname = "cloud"\nbase_url = "{leaky_url(remote_port)}"\n'
                    'model = "m"\napi_key_env = "EDGELLM_TEST_REMOTE_KEY"\ntimeout_s = 10\n'
                    '[fallback]\nremote_error = "error"\n', encoding="utf-8")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("remote_stub", ["echo"], indirect=True)
def test_no_credential_in_any_body_or_log_line(tiny: Any, tiny_root: Path, tmp_path: Path,
                                               remote_stub: tuple[int, list[dict[str, Any]]]) -> None:
    """A real `edgellm serve --route` process (its own logging set-up) routing to a remote that refuses and
    echoes the Authorization header and URL it got, and to one that is down: no credential in a body or a log."""
    remote_port, seen = remote_stub
    port = free_port()
    env = {**os.environ, "EDGELLM_TEST_REMOTE_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "edgellm", "serve", str(tiny_root / "art"), "--port", str(port),
                             "-t", "1", "--route", str(leaky_policy(remote_port, tmp_path))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    request = {**CHAT, "model": str(tiny_root / "art")}  # the name the server was started with
    bodies = []
    try:
        wait_healthy(url, 300, proc)
        r = httpx.post(url + "/v1/chat/completions", json=request, timeout=60)
        assert r.status_code == 401 and "invalid credentials" in r.text, r.text  # the remote's error, passed on
        bodies.append(r.text)
        with httpx.stream("POST", url + "/v1/chat/completions", json={**request, "stream": True}, timeout=60) as s:
            bodies.append(s.read().decode())
        assert len(seen) == 2 and seen[0]["authorization"]  # the credentials were sent (httpx: base_url's as Basic)
        assert QUERY_KEY in seen[0]["path"] and seen[0]["path"].startswith("/v1/chat/completions?")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    log = out.decode("utf-8", "replace")
    assert "model" in log and "ready" in log, log  # the log was captured
    for text in bodies + [log]:
        for secret in secret_forms():
            assert secret not in text, (secret, text)


def test_a_remote_that_is_down_is_named_without_its_credentials(tiny: Any, caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, with every logger at DEBUG and the server's logging set-up: the 502 names the remote's URL
    masked, and no log record (httpx's and httpcore's included) carries a credential."""
    import logging

    from edgellm.serve.app import configure_logging

    monkeypatch.setenv("EDGELLM_TEST_REMOTE_KEY", KEY)
    down = free_port()
    policy = parse_policy({"default": "cloud", "fallback": {"remote_error": "error"},
                           "remote": [{"name": "cloud", "base_url": leaky_url(down), "model": "m",
                                       "api_key_env": "EDGELLM_TEST_REMOTE_KEY", "timeout_s": 5}]})
    levels = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    caplog.set_level(logging.DEBUG)
    try:
        configure_logging([s for remote in policy.remotes.values() for s in remote_secrets(remote)])
        with running_server(lambda: tiny, policy=policy) as url:
            wait_ready(url)
            r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
            logging.getLogger("edgellm.serve").error("a line naming %s", leaky_url(down))
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for handler in logging.getLogger().handlers:
            handler.filters = [f for f in handler.filters if type(f).__name__ != "RedactingFilter"]
    message = assert_one_line_error(r, 502, code="remote_error")
    assert f"unreachable at http://{MASK}@127.0.0.1:{down}/v1?api-key={MASK}" in message, message
    assert "a line naming" in caplog.text
    for secret in secret_forms():
        assert secret not in caplog.text and secret not in r.text


# ------------------------------------------------------------------------------ finding 11: slowloris

SHORT = Connections(header_timeout_s=1.0, body_timeout_s=1.0, max_connections=50)


@pytest.fixture(scope="module")
def guarded(tiny: Any) -> Iterator[str]:
    with running_server(lambda: tiny, connections=SHORT) as url:
        wait_ready(url)
        yield url


def closed_by_server(sock: socket.socket, bound_s: float = 20.0) -> bytes:
    """Everything the server sent until it closed the connection; fails if it is still open after `bound_s`."""
    sock.settimeout(bound_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except socket.timeout:
        pytest.fail(f"the server kept the connection open for {bound_s} s (received {received[:80]!r})")
    except ConnectionResetError:
        pass
    return received


def test_connections_with_partial_heads_are_closed(guarded: str) -> None:
    socks = [socket.create_connection(("127.0.0.1", port_of(guarded)), timeout=10) for _ in range(30)]
    try:
        for i, sock in enumerate(socks):
            if i % 3:  # a request line and some headers, never the blank line that ends them
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        for sock in socks:
            assert closed_by_server(sock) == b""
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(guarded + "/health", timeout=30).status_code == 200  # still serving


def test_a_kept_alive_connection_with_a_partial_second_head_is_closed(guarded: str) -> None:
    with socket.create_connection(("127.0.0.1", port_of(guarded)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while not first.endswith(b"}"):  # the whole JSON reply
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 1")
        assert closed_by_server(sock) == b""


def test_a_partial_body_is_408_and_closed(guarded: str) -> None:
    with socket.create_connection(("127.0.0.1", port_of(guarded)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        reply = closed_by_server(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "body_timeout" and "--body-timeout" in error["message"]


def test_connections_over_the_cap_are_closed_at_once(tiny: Any) -> None:
    cap = Connections(header_timeout_s=120.0, body_timeout_s=120.0, max_connections=4)
    with running_server(lambda: tiny, connections=cap) as url:
        wait_ready(url)
        held = [socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) for _ in range(4)]
        try:
            time.sleep(0.5)  # the health polls' connections are gone; the four are the open ones
            extra = socket.create_connection(("127.0.0.1", port_of(url)), timeout=10)
            with extra:
                assert closed_by_server(extra, bound_s=30.0) == b""  # long before the 120 s head deadline
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 30
        while True:  # the server notices the four are gone, then answers again
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not serve again after the held sockets closed"
            time.sleep(0.1)


def test_connection_flags_default_as_documented_and_refuse_nonsense() -> None:
    import argparse

    from edgellm.serve.transport import add_connection_args, connections_from_args

    parser = argparse.ArgumentParser()
    add_connection_args(parser)
    assert connections_from_args(parser.parse_args([])) == Connections(10.0, 30.0, 100, 16384)
    given = parser.parse_args(["--header-timeout", "2.5", "--body-timeout", "4", "--max-connections", "7",
                               "--max-header-bytes", "4096"])
    assert connections_from_args(given) == Connections(2.5, 4.0, 7, 4096)
    for flag, value in (("--header-timeout", "0"), ("--body-timeout", "-1"), ("--header-timeout", "nan"),
                        ("--body-timeout", "inf"), ("--max-connections", "0"), ("--max-header-bytes", "0")):
        with pytest.raises(EdgeLLMError, match=flag):
            connections_from_args(parser.parse_args([flag, value]))


# ------------------------------------------------------------------------------ finding 12: 400, never 500


def raw_post(base: str, path: str, body: str) -> Any:
    return httpx.post(base + path, content=body.encode("utf-8"), headers={"content-type": "application/json"},
                      timeout=60)


SURROGATES = [
    ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "ok \\udfff"}]}]}', "messages.0.content.0.text"),
    ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": "\\udc00x"}', "prompt"),
    ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": ["a", "b\\ud83d"]}', "prompt.1"),
    ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "stop": ["\\ud800"], '
                             '"messages": [{"role": "user", "content": "x"}]}', "stop.0"),
    ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], '
                             '"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": '
                             '{"type": "object", "properties": {"\\ud800": {"type": "string"}}}}}}',
     "response_format.json_schema.schema.properties"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES)
def test_a_lone_surrogate_is_400_naming_the_field(base: str, path: str, body: str, param: str) -> None:
    r = raw_post(base, path, body % MODEL)
    message = assert_one_line_error(r, 400, code="invalid_value", param=param)
    assert "lone surrogate" in message


def test_a_valid_surrogate_pair_is_text(base: str) -> None:
    body = '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}' % MODEL
    assert raw_post(base, "/v1/chat/completions", body).status_code == 200


BAD_NUMBERS = [("repetition_penalty", v) for v in ("1e-300", "0", "-1", "1e-5", "1e300", "Infinity", "NaN")] + \
    [("temperature", v) for v in ("1e-300", "1e-45", "1e-30", "-1", "3", "NaN", "Infinity")] + \
    [("top_p", v) for v in ("0", "-1", "1.5", "NaN")] + \
    [("min_p", v) for v in ("-0.1", "2", "NaN")] + \
    [("presence_penalty", v) for v in ("3", "NaN", "Infinity")] + \
    [("frequency_penalty", v) for v in ("-Infinity", "-3")] + \
    [("top_k", v) for v in ("-1", "0.5")] + [("max_tokens", v) for v in ("0", "-5", "1e999")]


@pytest.mark.parametrize("field,value", BAD_NUMBERS)
def test_an_out_of_range_sampling_value_is_400_naming_the_field(base: str, field: str, value: str) -> None:
    for path, rest in (("/v1/chat/completions", '"messages": [{"role": "user", "content": "t1"}]'),
                       ("/v1/completions", '"prompt": "t1"')):
        defaults = {"max_tokens": "2"} if field != "max_tokens" else {}
        fields = ", ".join(f'"{k}": {v}' for k, v in {**defaults, field: value}.items())
        r = raw_post(base, path, '{"model": "%s", %s, %s}' % (MODEL, fields, rest))
        message = assert_one_line_error(r, 400, param=field)
        assert field in message


def test_a_non_finite_logit_bias_is_400(base: str) -> None:
    r = raw_post(base, "/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "logit_bias": {"5": NaN}, '
                                              '"messages": [{"role": "user", "content": "t1"}]}' % MODEL)
    assert_one_line_error(r, 400, param="logit_bias.5")


@pytest.mark.parametrize("field,value", [("temperature", 0), ("temperature", 0.001), ("temperature", 2),
                                         ("repetition_penalty", 0.01), ("repetition_penalty", 100),
                                         ("top_p", 1e-300), ("min_p", 1e-300), ("top_k", 10 ** 12)])
def test_sampling_values_at_the_edges_are_served(base: str, field: str, value: float) -> None:
    r = httpx.post(base + "/v1/chat/completions", json={**CHAT, field: value}, timeout=60)
    assert r.status_code == 200, r.text
