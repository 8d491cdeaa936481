"""A constrained request's grammar compiles off the engine's worker (issue 29 finding 6): while it compiles, a
plain request is served, and the request's deadline is honoured. The compile is held on a gate so the checks are
orderings, not timings: the plain reply arrives while the gate is still shut."""

from __future__ import annotations

import re
import threading
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.support.tiny_chat import tiny_chat_engine  # noqa: E402
from tests.serve.test_serve_api import running_server, wait_ready  # noqa: E402

REGEX = "(ab){1,4}"


class GatedCompile:
    """Wraps engine.constraint: a constrained call waits until `gate` opens; `entered` says one is waiting."""

    def __init__(self, engine: Any) -> None:
        self.inner = engine.constraint
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, params: Any) -> Any:
        if params.response_format is not None and params.response_format.type != "text":
            self.entered.set()
            self.gate.wait(120)
        return self.inner(params)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_chat_engine(tmp_path_factory.mktemp("tiny"))


@pytest.fixture()
def gated(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedCompile]:
    gate = GatedCompile(engine)
    monkeypatch.setattr(engine, "constraint", gate)
    yield gate
    gate.gate.set()


def _chat(base: str, timeout: float, **extra: Any) -> httpx.Response:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "t1"}], "max_tokens": 8, **extra}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=timeout)


def test_a_plain_request_is_served_while_a_grammar_compiles(engine: Any, gated: GatedCompile) -> None:
    with running_server(lambda: engine) as base:
        wait_ready(base)
        replies: dict[str, httpx.Response] = {}
        constrained = threading.Thread(target=lambda: replies.setdefault("regex", _chat(
            base, 120, response_format={"type": "regex", "regex": REGEX})))
        constrained.start()
        assert gated.entered.wait(60), "the grammar compile never started"
        plain = _chat(base, 30)  # on the engine's worker the compile would hold it: a read timeout here
        assert plain.status_code == 200, plain.text
        assert not gated.gate.is_set()  # served while the compile was still waiting
        gated.gate.set()
        constrained.join(120)
        assert replies["regex"].status_code == 200, replies["regex"].text
        assert re.fullmatch(REGEX, replies["regex"].json()["choices"][0]["message"]["content"])


def test_the_deadline_is_honoured_while_a_grammar_compiles(engine: Any, gated: GatedCompile) -> None:
    with running_server(lambda: engine, timeout_s=1.0) as base:
        wait_ready(base)
        reply = _chat(base, 30, response_format={"type": "regex", "regex": REGEX})
        assert reply.status_code == 408, reply.text
        assert reply.json()["error"]["code"] == "timeout"
        assert gated.entered.is_set() and not gated.gate.is_set()  # answered while the compile still waited
        gated.gate.set()
        assert _chat(base, 30).status_code == 200  # and the engine is free
