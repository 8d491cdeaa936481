"""The Ollama-compatible endpoints with the official `ollama` Python client, unchanged, against a real loopback
server: a tiny random chat model (byte tokenizer, fast) for every endpoint and error, and once the real SmolLM2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from edgellm.artifact.reader import open_artifact  # noqa: E402
from edgellm.runtime.engine import Engine  # noqa: E402
from tests.support.tiny_chat import tiny_chat_engine  # noqa: E402
from tests.serve.test_serve_api import running_server, wait_ready  # noqa: E402

NAME = "tiny-chat"
USER = [{"role": "user", "content": "t1 t2 t3"}]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An EDGELLM_HOME of this module's own (leases and listings land there, never in the shared cache)."""
    root = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGELLM_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, home: Path) -> Any:
    return tiny_chat_engine(tmp_path_factory.mktemp("tiny"))


def _open(folder: Path) -> Engine:
    return Engine(open_artifact(folder), threads=1)


@pytest.fixture(scope="module")
def base(tiny: Any) -> Iterator[str]:
    folder = Path(tiny.artifact.folder)
    with running_server(lambda: _open(folder), NAME, load_model=_open) as url:
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> Any:
    return ollama.Client(host=base, timeout=60)


def test_chat_whole(client: Any) -> None:
    r = client.chat(model=NAME, messages=USER, options={"num_predict": 5, "temperature": 0})
    assert r.model == NAME and r.done is True and r.done_reason in ("stop", "length")
    assert r.message.role == "assistant" and isinstance(r.message.content, str)
    assert r.prompt_eval_count > 0 and 0 < r.eval_count <= 5
    assert r.total_duration >= r.prompt_eval_duration > 0  # nanoseconds
    assert r.created_at.endswith("Z")


def test_chat_streamed_equals_whole_for_a_seed(client: Any) -> None:
    args = dict(model=NAME, messages=USER, options={"num_predict": 8, "seed": 3, "temperature": 0.9})
    whole = client.chat(**args)
    parts = list(client.chat(stream=True, **args))
    assert whole.eval_count >= 2 and len(parts) >= 2  # one object per piece of text, then the final one
    assert all(p.done is False for p in parts[:-1]) and parts[-1].done is True
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason


def test_generate_templated_and_raw(client: Any, tiny: Any) -> None:
    r = client.generate(model=NAME, prompt="t1 t2", options={"num_predict": 4, "temperature": 0})
    chat_prompt = len(tiny.encode(tiny.render([{"role": "user", "content": "t1 t2"}])))
    assert r.done and r.prompt_eval_count == chat_prompt and r.eval_count <= 4
    raw = client.generate(model=NAME, prompt="t1 t2", raw=True, options={"num_predict": 4, "temperature": 0})
    assert raw.prompt_eval_count == len(tiny.encode("t1 t2"))
    parts = list(client.generate(model=NAME, prompt="t1 t2", stream=True, options={"num_predict": 4,
                                                                                  "temperature": 0}))
    assert "".join(p.response for p in parts) == r.response
    with httpx.stream("POST", client._client.base_url.join("/api/generate"),
                      json={"model": NAME, "prompt": "t1", "options": {"num_predict": 3}}) as streamed:
        lines = [json.loads(line) for line in streamed.iter_lines()]
        assert streamed.headers["content-type"] == "application/x-ndjson"  # Ollama streams by default
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])


def test_options_are_honoured(client: Any) -> None:
    r = client.chat(model=NAME, messages=USER, options={"num_predict": 3, "temperature": 0})
    assert r.eval_count <= 3
    a = client.chat(model=NAME, messages=USER, options={"num_predict": 6, "seed": 11, "temperature": 1.0,
                                                        "top_k": 5, "top_p": 0.9, "repeat_penalty": 1.1})
    b = client.chat(model=NAME, messages=USER, options={"num_predict": 6, "seed": 11, "temperature": 1.0,
                                                        "top_k": 5, "top_p": 0.9, "repeat_penalty": 1.1})
    assert a.message.content == b.message.content
    whole = client.generate(model=NAME, prompt="t1", raw=True, options={"num_predict": 12, "temperature": 0})
    if len(whole.response) > 2:
        stop = whole.response[1:3]
        cut = client.generate(model=NAME, prompt="t1", raw=True,
                              options={"num_predict": 12, "temperature": 0, "stop": [stop]})
        assert stop not in cut.response and cut.done_reason == "stop"


def test_num_ctx_caps_the_reply(client: Any, tiny: Any) -> None:
    prompt = len(tiny.encode("t1 t2"))
    r = client.generate(model=NAME, prompt="t1 t2", raw=True,
                        options={"num_ctx": prompt + 2, "num_predict": 50, "temperature": 0})
    assert r.eval_count <= 2
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model=NAME, prompt="t1 t2", raw=True, options={"num_ctx": prompt})
    assert err.value.status_code == 400 and "context" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model=NAME, prompt="t1", options={"num_ctx": tiny.context_window + 1})
    assert err.value.status_code == 400 and "num_ctx" in err.value.error


@pytest.mark.parametrize("options, named", [({"mirostat": 1}, "mirostat"), ({"num_gpu": 1}, "num_gpu"),
                                            ({"bogus": 1, "tfs_z": 1.0}, "bogus, tfs_z"),
                                            ({"num_predict": -1}, "num_predict"),
                                            ({"temperature": 9}, "temperature")])
def test_unsupported_options_are_refused(client: Any, options: dict[str, Any], named: str) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=NAME, messages=USER, options=options)
    assert err.value.status_code == 400 and named in err.value.error


def test_unsupported_fields_are_refused(base: str) -> None:
    for body, named in (({"images": ["aGk="]}, "images"), ({"suffix": "x"}, "suffix"), ({"think": True}, "think"),
                        ({"nonsense": 1}, "nonsense"), ({"keep_alive": "5 minutes"}, "keep_alive")):
        r = httpx.post(base + "/api/generate", json={"model": NAME, "prompt": "t1", "stream": False, **body})
        assert r.status_code == 400 and named in r.json()["error"], (body, r.text)


def test_structured_format(client: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    r = client.chat(model=NAME, messages=USER, format=schema, options={"num_predict": 200, "seed": 1})
    jsonschema.validate(json.loads(r.message.content), schema)
    j = client.generate(model=NAME, prompt="t1", format="json", options={"num_predict": 200, "seed": 2})
    assert isinstance(json.loads(j.response), dict)
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=NAME, messages=USER, format={"type": "object", "properties": {"a": {"type": "nope"}}})
    assert err.value.status_code == 400


def test_errors_are_ollama_shaped(client: Any, base: str) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="no-such-model", messages=USER)
    assert err.value.status_code == 404 and isinstance(err.value.error, str) and "no-such-model" in err.value.error
    r = httpx.post(base + "/api/chat", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    body = json.dumps({"model": NAME, "prompt": "t1", "stream": False}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):  # what a web page may send unasked
        r = httpx.post(base + "/api/generate", content=body, headers={"content-type": kind} if kind else {})
        assert r.status_code == 415 and "application/json" in r.json()["error"]


def test_list_show_ps_version(client: Any, tiny: Any) -> None:
    listed = client.list()
    assert NAME in [m.model for m in listed.models]
    card = next(m for m in listed.models if m.model == NAME)
    assert card.size > 0 and card.details.family == "llama" and card.details.quantization_level == "q0f32"
    shown = client.show(NAME)
    assert "{% for m in messages %}" in shown.template
    assert shown.modelinfo["llama.context_length"] == tiny.context_window
    assert f"temperature {tiny.config.sampling.temperature}" in shown.parameters.splitlines()
    raw = httpx.post(client._client.base_url.join("/api/show"), json={"model": NAME}).json()
    assert raw["edgellm"]["tuning"] == {"kind": "unknown", "source": "no config name or folder name says instruct or base"}
    running = client.ps()
    resident = next(m for m in running.models if m.model == NAME)
    assert resident.expires_at is None and resident.context_length == tiny.context_window and resident.size > 0
    assert httpx.get(client._client.base_url.join("/api/version")).json()["version"]


def test_an_api_key_covers_the_ollama_routes(tiny: Any) -> None:
    with running_server(lambda: tiny, NAME, api_key="k3y") as url:
        wait_ready(url)
        with pytest.raises(ollama.ResponseError) as err:
            ollama.Client(host=url).list()
        assert err.value.status_code == 401
        keyed = ollama.Client(host=url, headers={"Authorization": "Bearer k3y"})
        assert [m.model for m in keyed.list().models] == [NAME]


def test_keep_alive_zero_still_serves_openai_requests(tiny: Any) -> None:
    """With --keep-alive 0 the model unloads after each request, but never before the request's job runs."""
    openai = pytest.importorskip("openai")
    from edgellm.serve.model_host import KeepAlive

    folder = Path(tiny.artifact.folder)
    with running_server(lambda: _open(folder), NAME, load_model=_open, keep_alive=KeepAlive(0.0)) as url:
        wait_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        for _ in range(2):
            r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=2)
            assert r.choices[0].finish_reason in ("stop", "length")


def test_pull_and_delete_a_second_model(client: Any, base: str, tiny: Any, home: Path) -> None:
    """A model compiled into the cache is listed, served on first request by its name, and deleted."""
    other = home / "artifacts" / "other-tiny"
    shutil.copytree(tiny.artifact.folder, other)
    name = str(other)
    assert name in [m.model for m in client.list().models]
    r = client.chat(model=name, messages=USER, options={"num_predict": 2}, keep_alive=0)
    assert r.done
    assert name not in [m.model for m in client.ps().models]  # keep_alive 0: unloaded after the reply
    assert client.delete(name).status == "success"
    assert not other.exists() and name not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as err:
        client.delete(name)
    assert err.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("no-such-catalog-model")
    assert err.value.status_code == 404 and "catalog" in err.value.error


def test_pull_compiles_a_gguf_file(client: Any, tmp_path: Path) -> None:
    """/api/pull with a .gguf path compiles it into the cache (as `run x.gguf` would); streamed, it reports
    progress then success; the compiled model is listed and answers."""
    pytest.importorskip("transformers")
    from tests.e2e.test_gguf_first_use import _gguf

    gguf = _gguf(tmp_path / "pulled.gguf", 0)
    statuses = [p.status for p in client.pull(str(gguf), stream=True)]
    assert statuses[0].startswith("pulling") and statuses[-1] == "success"
    [name] = [m.model for m in client.list().models if "pulled-" in m.model]
    assert name.endswith("-source") and client.show(name).details.family == "qwen3"
    assert client.pull(str(gguf)).status == "success"  # again: cached, nothing to do
    with pytest.raises(ollama.ResponseError) as err:
        client.pull(str(tmp_path / "missing.gguf"))
    assert err.value.status_code == 404


# the catalog default artifact in the shared cache (this module's EDGELLM_HOME is its own, so named by path)
REAL_SMOLLM2 = Path.home() / ".cache/edgellm/artifacts/smollm2-135m-source"


@pytest.mark.skipif(not REAL_SMOLLM2.is_dir(), reason="the real SmolLM2 is not compiled here")
def test_real_smollm2_through_the_ollama_client() -> None:
    engine = Engine(open_artifact(REAL_SMOLLM2), threads=2)
    with running_server(lambda: engine, "smollm2-135m") as url:
        wait_ready(url)
        client = ollama.Client(host=url, timeout=120)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat(model="smollm2-135m", messages=question, options={"num_predict": 12, "temperature": 0})
        assert "Paris" in r.message.content
        parts = list(client.chat(model="smollm2-135m:latest", messages=question, stream=True,
                                 options={"num_predict": 12, "temperature": 0}))
        assert "".join(p.message.content for p in parts) == r.message.content
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
        s = client.chat(model="smollm2-135m", messages=question, format=schema, options={"num_predict": 60,
                                                                                         "temperature": 0})
        assert "Paris" in json.loads(s.message.content)["city"]
        assert [m.model for m in client.ps().models] == ["smollm2-135m"]
        assert client.show("smollm2-135m").details.family == "llama"
