"""Never blank: the caller's rule answers, flagged, on an injected failure and on a deadline (API and server)."""

from __future__ import annotations

import re
import time
from typing import Any, Sequence

import pytest
import torch

from edgellm.errors import EdgeLLMError
from edgellm.runtime.engine import Engine
from edgellm.runtime.rule_answer import generate_with_fallback, load_rule
from edgellm.generation import GenerationParams
from tests.support.tiny import tiny_engine

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def form_rule(request: Any, reason: str) -> str:
    """A rule-based answer: pull an e-mail address out of the request text."""
    text = request if isinstance(request, str) else " ".join(m["content"] for m in request)
    found = re.search(r"[\w.]+@[\w.]+", text)
    return f'{{"email": "{found.group(0) if found else ""}"}}'


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    e = tiny_engine(tmp_path_factory.mktemp("fallback"), "llama", tied=True)
    e.chat_template = TEMPLATE
    return e


def failing(generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("injected failure")


def slow(generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    time.sleep(0.05)
    return logits


def wait_idle(engine: Engine) -> None:
    deadline = time.monotonic() + 30
    while engine._lock.locked():
        assert time.monotonic() < deadline, "the cancelled generation never stopped"
        time.sleep(0.01)


def test_success_is_the_models_answer(engine: Engine) -> None:
    p = GenerationParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    r = generate_with_fallback(engine, "t1 t2", p, rule=form_rule, deadline_s=60)
    assert not r.fallback and r.fallback_reason is None and len(r.token_ids) == 3
    assert r.token_ids == engine.generate("t1 t2", p).token_ids


def test_injected_failure_gives_the_flagged_rule_answer(engine: Engine) -> None:
    messages = [{"role": "user", "content": "reach me at ada@example.org t5"}]
    r = generate_with_fallback(engine, messages, GenerationParams(logits_processors=(failing,)), rule=form_rule)
    assert r.fallback and r.text == '{"email": "ada@example.org"}' and r.token_ids == []
    assert r.fallback_reason == "generation failed: RuntimeError" and r.finish_reason == "stop"
    r = generate_with_fallback(engine, "", rule=form_rule)  # an engine error (empty prompt) says what it was
    assert r.fallback and r.fallback_reason == "generation failed: the prompt is empty"


def test_deadline_gives_the_rule_answer_and_stops_the_generation(engine: Engine) -> None:
    p = GenerationParams(max_tokens=200, ignore_eos=True, logits_processors=(slow,))
    t0 = time.monotonic()
    r = generate_with_fallback(engine, "t1 t2 x@y.z", p, rule=form_rule, deadline_s=0.3)
    assert time.monotonic() - t0 < 5  # 200 slow tokens would take 10 s
    assert r.fallback and r.fallback_reason == "no answer within the deadline of 0.3 s"
    assert r.text == '{"email": "x@y.z"}'
    wait_idle(engine)  # the generation stops at its next token and frees the engine
    assert len(engine.generate("t1", GenerationParams(max_tokens=2, ignore_eos=True)).token_ids) == 2


def test_a_failing_rule_and_bad_specs_are_one_line_errors(engine: Engine) -> None:
    def broken(request: Any, reason: str) -> str:
        raise KeyError("x")

    with pytest.raises(EdgeLLMError, match=r"the fallback failed too \(generation failed: RuntimeError\): KeyError"):
        generate_with_fallback(engine, "t1", GenerationParams(logits_processors=(failing,)), rule=broken)
    for spec, message in (("nocolon", "must be MODULE:FUNCTION"), ("no_such_mod_xyz:f", "cannot import"),
                          ("json:nothing_here", "has no function 'nothing_here'")):
        with pytest.raises(EdgeLLMError, match=message):
            load_rule(spec)
    assert load_rule("tests.runtime.test_device_fallback:form_rule") is form_rule


# ---- the server ------------------------------------------------------------------------------------------
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


class SlowModel:
    """The engine's model, 50 ms slower per call: a generation that cannot meet a short timeout."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        return self.model.run(*args, **kwargs)


def test_server_answers_with_the_flagged_fallback() -> None:
    from tests.serve.test_serve_api import MODEL, running_server

    def broken_loader() -> Any:
        raise EdgeLLMError("memory: 900 MiB needed > 100 MiB budget")

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "mail bo@example.com"}], "max_tokens": 4}
    with running_server(broken_loader, fallback=form_rule) as url:
        time.sleep(0.5)  # the load fails in its background thread
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["fallback"] is True and "failed to load" in body["fallback_reason"]
        assert body["choices"][0]["message"]["content"] == '{"email": "bo@example.com"}'
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a@b.c", "stream": True}, timeout=60)
        assert r.status_code == 200 and '"fallback":true' in r.text and r.text.rstrip().endswith("data: [DONE]")
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "max_tokens": -1}, timeout=60)
        assert r.status_code == 400  # the client's own mistake is not papered over
    with running_server(broken_loader) as url:
        time.sleep(0.5)
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 503


def test_server_timeout_gives_the_fallback(engine: Engine) -> None:
    from tests.serve.test_serve_api import MODEL, running_server, wait_ready

    slow_engine = Engine(engine.artifact, threads=1)
    slow_engine.chat_template = TEMPLATE
    slow_engine.model = SlowModel(slow_engine.model)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "t1 c@d.e"}], "max_tokens": 200,
            "logit_bias": {"255": -100}}
    with running_server(lambda: slow_engine, timeout_s=0.5, fallback=form_rule) as url:
        wait_ready(url)
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["fallback"] is True and "timeout" in r.json()["fallback_reason"]
        assert r.json()["choices"][0]["message"]["content"] == '{"email": "c@d.e"}'
