"""Continuous batching through the real HTTP server with the real SmolLM2: four streamed chat requests at once get
the replies each gets alone, the OpenAI and Ollama routes alike, and the server's metrics show the steps batched."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from edgellm.runtime.engine import Engine  # noqa: E402
from tests.serve.test_serve_api import MODEL, running_server, wait_ready  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to five.",
             "What do bees make?"]


def _stream_chat(base: str, question: str) -> str:
    """One streamed greedy chat reply (SSE), its text."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "stream": True,
            "temperature": 0, "max_tokens": 48}
    text = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def _ollama_chat(base: str, question: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}],
            "options": {"temperature": 0, "num_predict": 48}}
    text = []
    with httpx.stream("POST", base + "/api/chat", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line:
                text.append(json.loads(line).get("message", {}).get("content", ""))
    return "".join(text)


def _at_once(call: Any, base: str) -> list[str]:
    out: list[str] = [""] * len(QUESTIONS)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = call(base, QUESTIONS[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    return out


def _batched_rows(base: str) -> tuple[int, float]:
    """(decode steps, rows they ran) from /metrics."""
    metrics = httpx.get(base + "/metrics", timeout=10).text
    count = re.search(r"^edgellm_decode_step_rows_count (\S+)$", metrics, re.M)
    total = re.search(r"^edgellm_decode_step_rows_sum (\S+)$", metrics, re.M)
    assert count and total
    return int(float(count.group(1))), float(total.group(1))


@pytest.mark.parametrize("route", ["openai", "ollama"])
def test_four_concurrent_streams_equal_their_solo_replies(route: str) -> None:
    engine = Engine.load(MODEL, progress=False, threads=2, sequences=4)
    call = _stream_chat if route == "openai" else _ollama_chat
    try:
        with running_server(lambda: engine, max_queue=4) as base:
            wait_ready(base)
            solo = [call(base, q) for q in QUESTIONS]
            steps, rows = _batched_rows(base)
            assert rows == steps  # alone, every step decodes one row
            together = _at_once(call, base)
            steps2, rows2 = _batched_rows(base)
        assert together == solo and all(solo)
        assert rows2 - rows > steps2 - steps  # some steps decoded several streams at once
    finally:
        engine.close()
