"""CLI promises from README.md and docs/: `edgellm eval task` end to end (and its report through the gate),
`--memory-budget` (refusal with the numbers, fitting, `--degrade`), the chat banner's memory estimate, and
`edgellm serve`'s `--host` warning and `$EDGELLM_API_KEY`. Each runs the real command on smollm2-135m's artifact."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_cli import assert_one_line_error, edgellm

MIB = 2**20


@pytest.fixture(scope="module")
def artifact(smollm2_gguf: Path) -> Path:
    from edgellm.resolve import resolve_model

    return resolve_model("smollm2-135m", progress=False)


@pytest.fixture()
def bare_home(tmp_path: Path) -> dict[str, str]:
    """An empty $EDGELLM_HOME: the model is given as a folder, and the memory planner finds no other catalog
    model to read (reading the pulled GGUFs of the others costs ~25 s per command on a busy machine)."""
    return {"EDGELLM_HOME": str(tmp_path / "home")}


# ---- eval task, and the gate on its real reports --------------------------------------------------------
def _item(n: int, gold: str) -> dict[str, Any]:
    """The grammar allows only "Paris": the constrained reply is fixed, and right exactly when gold is Paris."""
    return {"id": f"city-{n}", "lang": "en", "scenario": "city", "input": f"Note {n}: I live in Paris.",
            "schema": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
                       "additionalProperties": False},
            "gold": {"city": gold}}


def _eval_task(artifact: Path, folder: Path, golds: list[str], env: dict[str, str]) -> tuple[str, dict[str, Any]]:
    dataset = folder / f"{'-'.join(golds)}.jsonl"
    dataset.write_text("".join(json.dumps(_item(n, g)) + "\n" for n, g in enumerate(golds)))
    report = folder / f"{'-'.join(golds)}.json"
    proc = edgellm("eval", "task", str(artifact), "--dataset", str(dataset), "--modes", "constrained",
                   "--max-tokens", "40", "--threads", "1", "--failures", "5", "--json", str(report), "--quiet",
                   env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(report.read_text())


def test_eval_task_scores_real_replies_and_the_gate_reads_them(artifact: Path, tmp_path: Path,
                                                               bare_home: dict[str, str]) -> None:
    out, half = _eval_task(artifact, tmp_path, ["Paris", "Lyon"], bare_home)
    m = half["modes"]["constrained"]
    assert (m["items"], m["valid_json"], m["fields_complete"], m["values_correct"]) == (2, 100.0, 100.0, 50.0)
    assert half["rates"] == {"constrained.valid_json": 100.0, "constrained.fields_complete": 100.0,
                             "constrained.values_correct": 50.0}
    assert half["model"] == artifact.name and m["per_field"] == {"city.city": 50.0}
    (failure,) = m["failures"]
    assert failure["id"] == "city-1" and "gold 'Lyon'" in failure["reason"]
    assert json.loads(failure["output"]) == {"city": "Paris"}
    assert re.search(r"constrained\s+2\s+100\.0%\s+100\.0%\s+50\.0%", out), out
    assert "[constrained] city-1: wrong city='Paris' (gold 'Lyon')" in out

    _, none = _eval_task(artifact, tmp_path, ["Lyon", "Lyon"], bare_home)
    assert none["rates"]["constrained.values_correct"] == 0.0
    same = edgellm("eval", "gate", "--baseline", str(tmp_path / "Paris-Lyon.json"),
                   "--candidate", str(tmp_path / "Paris-Lyon.json"))
    assert same.returncode == 0 and "gate: passed" in same.stdout
    drop = edgellm("eval", "gate", "--baseline", str(tmp_path / "Paris-Lyon.json"),
                   "--candidate", str(tmp_path / "Lyon-Lyon.json"))
    assert drop.returncode == 1
    assert re.search(r"constrained\.values_correct\s+50\.00\s+0\.00\s+-50\.00\s+FAIL", drop.stdout), drop.stdout
    assert "1 of 3 rates dropped" in drop.stdout


# ---- --memory-budget and the chat banner ------------------------------------------------------------------
def _estimate(artifact: Path, *args: str) -> dict[str, Any]:
    proc = edgellm("info", str(artifact), "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["memory_estimate_bytes"]


def test_memory_budget_refuses_fits_and_degrades(artifact: Path, bare_home: dict[str, str]) -> None:
    total = _estimate(artifact)["total"]
    below = math.ceil(total / MIB) - 1  # one MiB short of the estimate
    refused = edgellm("run", str(artifact), "Hi", "-n", "1", "--threads", "1", "--memory-budget", str(below),
                      env=bare_home)
    assert_one_line_error(refused, rf"memory: {round(total / MIB)} MiB needed > {below} MiB budget "
                                   r"\(--memory-budget\)")
    fits = edgellm("run", str(artifact), "Hi", "-n", "1", "--threads", "1", "--stats",
                   "--memory-budget", str(math.ceil(total / MIB)), env=bare_home)
    assert fits.returncode == 0 and fits.stdout.strip(), fits.stderr
    degraded = edgellm("run", str(artifact), "Hi", "-n", "1", "--threads", "1", "--stats", "--memory-budget",
                       str(below), "--degrade", env=bare_home)
    assert degraded.returncode == 0 and degraded.stdout.strip(), degraded.stderr
    window = int(re.search(r"using context (\d+)", degraded.stderr).group(1))
    shorter = _estimate(artifact, "--context-window", str(window))["total"]
    assert window < 4096 and shorter <= below * MIB  # the step it took really fits the budget
    assert f"memory estimate {round(shorter / MIB)} MiB" in degraded.stderr


def _banner(artifact: Path, env: dict[str, str], *args: str) -> str:
    proc = edgellm("chat", str(artifact), "--threads", "1", *args, stdin="/exit\n", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("chatting with")]
    assert len(lines) == 1, proc.stderr
    return re.search(r"memory estimate (.*)\)\. Commands", lines[0]).group(1)


def _info_line(artifact: Path, *args: str) -> str:
    proc = edgellm("info", str(artifact), *args)
    return re.search(r"^estimated memory\s+(.*)$", proc.stdout, re.M).group(1)


def test_chat_banner_states_the_memory_estimate(artifact: Path, bare_home: dict[str, str]) -> None:
    full = _banner(artifact, bare_home)
    assert full == _info_line(artifact)
    assert re.fullmatch(r"\d+ MiB \(weights \d+ \+ KV cache \d+ f16 at the full window, allocated as it fills "
                        r"\+ working buffers \d+ \+ tokenizer \d+\)", full), full
    short = _banner(artifact, bare_home, "--context-window", "1024")
    assert short == _info_line(artifact, "--context-window", "1024") and short != full
    kv = lambda text: int(re.search(r"KV cache (\d+)", text).group(1))  # noqa: E731
    assert kv(short) * 4 == pytest.approx(kv(full), abs=4)  # a quarter of the window: a quarter of the KV cache


# ---- edgellm serve: --host warning and $EDGELLM_API_KEY ------------------------------------------------------
def _free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def _serve(artifact: Path, port: int, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgellm.cli", "serve", str(artifact), "--host", "0.0.0.0",
                             "--port", str(port), "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "EDGELLM_API_KEY"} | env)


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err
    return err


def test_serve_on_all_interfaces_without_a_key_warns(artifact: Path, bare_home: dict[str, str]) -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    port = _free_port()
    proc = _serve(artifact, port, bare_home)
    try:
        _wait_listening(httpx, proc, port)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200  # open to all
    finally:
        err = _stop(proc)  # Ctrl-C while the model is most likely still loading: once a SIGABRT (exit -6)
    warnings = [line for line in err.splitlines() if "without --api-key" in line]
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0] and warnings[0].startswith("WARNING"), err


def test_serve_takes_the_api_key_from_the_environment(artifact: Path, bare_home: dict[str, str]) -> None:
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    port = _free_port()
    proc = _serve(artifact, port, {**bare_home, "EDGELLM_API_KEY": "env-k3y"})
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_listening(httpx, proc, port)
        r = httpx.get(base + "/v1/models", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=base + "/v1", api_key="env-k3y", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == [str(artifact)]
        _wait_ready(httpx, proc, base)
        reply = client.chat.completions.create(model=artifact.name, max_tokens=2,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert reply.usage.completion_tokens >= 1
    finally:
        err = _stop(proc)
    assert "without --api-key" not in err  # the key from the environment counts as a key


def _wait_listening(httpx: Any, proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the server never listened"
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except httpx.TransportError:
            time.sleep(0.2)


def _wait_ready(httpx: Any, proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + 120
    while httpx.get(base + "/health", timeout=5).status_code != 200:
        assert proc.poll() is None and time.monotonic() < deadline, "the model did not load"
        time.sleep(0.2)
