"""The official `ollama` Python client, unchanged, against `edgellm serve` with a real catalog model, once.

Starts `edgellm serve MODEL` in a fresh process on a free loopback port, with an EDGELLM_HOME of its own (the
model's source file linked from the shared cache, its compiled artifact copied) so that pull and delete act on
that home only; then runs each call and prints a markdown table of call → ok / what it returned / wall time.

    PYTHONPATH=. python scripts/ollama_client_check.py [--model smollm2-135m] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import jsonschema
import ollama

from edgellm.catalog import get_entry
from edgellm.paths import artifacts_dir, sources_dir
from edgellm.resolve import resolve_model
from edgellm.serve.soak import free_port, wait_healthy

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "country": {"type": "string", "maxLength": 40}},
          "required": ["city", "country"], "additionalProperties": False}


def own_home(model: str, root: Path) -> Path:
    """An EDGELLM_HOME holding `model`'s source (linked, with its sha256 sidecar copied) and its default artifact
    (copied from the shared cache, compiled there first if needed)."""
    entry = get_entry(model)
    shared_artifact = resolve_model(model, progress=True)
    source = sources_dir() / model / entry.filename
    (root / "sources" / model).mkdir(parents=True)
    (root / "sources" / model / entry.filename).symlink_to(source)
    shutil.copy(source.with_name(source.name + ".sha256"), root / "sources" / model)
    shutil.copytree(shared_artifact, root / "artifacts" / shared_artifact.relative_to(artifacts_dir()))
    return root


def start_server(model: str, home: Path, port: int, threads: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "EDGELLM_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "serve", model, "--port", str(port),
                             "--threads", str(threads)], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(home / "server.log", "wb"))
    wait_healthy(f"http://127.0.0.1:{port}", 600, proc)  # the log in home/server.log says why, if it exits
    return proc


def calls(client: ollama.Client, model: str, pulled: str) -> list[tuple[str, Callable[[], str]]]:
    """(call, a function that makes it and returns what it showed; it raises when the answer is wrong)."""
    greedy = {"num_predict": 24, "temperature": 0}
    whole: dict[str, str] = {}

    def listed() -> str:
        names = [m.model for m in client.list().models]
        assert model in names, names
        return f"{len(names)} local model(s), {model} among them"

    def show() -> str:
        r = client.show(model)
        assert r.details.family and r.template, r
        return f"family {r.details.family}, {r.details.parameter_size}, {r.details.quantization_level}, template"

    def chat_whole() -> str:
        r = client.chat(model=model, messages=QUESTION, options=greedy)
        assert r.done and r.message.content, r
        whole["text"] = r.message.content
        return f"{r.eval_count} tokens: {r.message.content.strip()[:60]!r}"

    def chat_streamed() -> str:
        parts = list(client.chat(model=model, messages=QUESTION, options=greedy, stream=True))
        text = "".join(p.message.content for p in parts)
        assert parts[-1].done and text == whole["text"], (text, whole)
        return f"{len(parts)} chunks, the same text as whole"

    def generate() -> str:
        r = client.generate(model=model, prompt="Name one colour of the rainbow.", options=greedy)
        assert r.done and r.response, r
        return f"{r.eval_count} tokens: {r.response.strip()[:60]!r}"

    def json_format() -> str:
        r = client.chat(model=model, messages=QUESTION, format="json", options={"num_predict": 60, "temperature": 0})
        value = json.loads(r.message.content)
        assert isinstance(value, dict), value
        return f"a JSON object: {r.message.content.strip()[:60]}"

    def schema_format() -> str:
        r = client.chat(model=model, messages=QUESTION, format=SCHEMA, options={"num_predict": 60, "temperature": 0})
        jsonschema.validate(json.loads(r.message.content), SCHEMA)
        return f"valid for the schema: {r.message.content.strip()[:60]}"

    def ps() -> str:
        running = client.ps().models
        assert [m.model for m in running] == [model], running
        return f"{model} resident, {running[0].size / 2**20:.0f} MiB estimated"

    def pull() -> str:
        statuses = [p.status for p in client.pull(pulled, stream=True)]
        assert statuses[-1] == "success", statuses
        assert pulled in [m.model for m in client.list().models]
        return f"compiled; streamed {' → '.join(statuses)}"

    def chat_pulled() -> str:
        r = client.chat(model=pulled, messages=QUESTION, options=greedy, keep_alive=0)
        assert r.done and pulled not in [m.model for m in client.ps().models]
        return f"loaded on first request, unloaded (keep_alive 0): {r.message.content.strip()[:40]!r}"

    def delete() -> str:
        assert client.delete(pulled).status == "success"
        assert pulled not in [m.model for m in client.list().models]
        return "removed from disk and from the list"

    return [("list", listed), ("show", show), ("chat (whole)", chat_whole), ("chat (streamed)", chat_streamed),
            ("generate", generate), ('chat format="json"', json_format), ("chat format=schema", schema_format),
            ("ps", ps), (f"pull {pulled} (streamed)", pull), (f"chat {pulled}", chat_pulled),
            (f"delete {pulled}", delete)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pull", default=None, help="what to pull then delete (default MODEL:q8f16_1)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    pulled = args.pull or f"{args.model}:q8f16_1"
    with tempfile.TemporaryDirectory(prefix="ollama-check-") as tmp:
        home = own_home(args.model, Path(tmp))
        port = free_port()
        t0 = time.perf_counter()
        server = start_server(args.model, home, port, args.threads)
        ready_s = time.perf_counter() - t0
        failures = 0
        try:
            client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=600)
            print(f"ollama {ollama_version()} client, edgellm serve {args.model} ready in {ready_s:.1f} s; "
                  f"load average {open('/proc/loadavg').read().split()[0]} before")
            print("\n| call | result | wall |\n|---|---|---|")
            for name, call in calls(client, args.model, pulled):
                t = time.perf_counter()
                try:
                    shown, ok = call(), "ok"
                except Exception as exc:  # noqa: BLE001 - a failed call is a row, the others still run
                    shown, ok, failures = f"{type(exc).__name__}: {exc}"[:120], "FAILED", failures + 1
                print(f"| {name} | {ok}: {shown} | {time.perf_counter() - t:.2f} s |", flush=True)
            print(f"\nload average {open('/proc/loadavg').read().split()[0]} after")
        finally:
            server.terminate()
            server.wait(timeout=60)
    return 1 if failures else 0


def ollama_version() -> str:
    from importlib.metadata import version

    return version("ollama")


if __name__ == "__main__":
    sys.exit(main())
