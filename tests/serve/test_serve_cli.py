"""`edgellm serve` as a user runs it: a subprocess that binds to loopback, loads, answers, and stops on Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")


def test_serve_verb_loads_answers_and_stops() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "serve", "smollm2-135m", "--port", str(port),
                             "--api-key", "k3y", "--threads", "1", "--max-queue", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        status = None
        while status != 200:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the server never became ready"
            try:
                status = httpx.get(base + "/health", timeout=5).status_code
                assert status in (200, 503)
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        # Bound to loopback, not reachable from other hosts (a 0.0.0.0 bind would answer 127.0.0.1 too).
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip == "127.0.0.1" and addr.port == port for addr in listening), listening
        assert httpx.get(base + "/v1/models", timeout=5).status_code == 401
        r = httpx.post(base + "/v1/completions", headers={"Authorization": "Bearer k3y"}, timeout=120,
                       json={"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "Hello" not in err  # prompts are never logged


def test_serve_verb_without_the_extra_is_a_one_line_error() -> None:
    code = ("import sys; sys.modules['fastapi'] = None; from edgellm.cli import main; "
            "sys.exit(main(['serve', 'smollm2-135m']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "edgellm: error: `edgellm serve` needs the serve extra: pip install 'edgellm[serve]'"]


def test_serve_verb_with_an_unknown_model_fails_before_binding() -> None:
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli", "serve", "no-such-model"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgellm: error: no such model 'no-such-model'"), proc.stderr
