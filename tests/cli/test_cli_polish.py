"""The small promises of issue 28: one-line errors (run without a prompt, a busy port), help texts that list what
exists (pull's catalog, chat's commands, -n's default, --port), chat's /help, doctor's repair hint only with a
channel."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgellm.catalog import CATALOG
from edgellm.chat_repl import ChatRepl


def edgellm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120)


def one_line_error(proc: subprocess.CompletedProcess, code: int = 1) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgellm: error: "), proc.stderr
    return lines[0]


def test_run_without_a_prompt_is_one_line() -> None:
    line = one_line_error(edgellm("run", "smollm2-135m"), 2)  # a usage error, as argparse's code says
    assert "PROMPT" in line and "edgellm chat" in line
    other = one_line_error(edgellm("run", "smollm2-135m", "hi", "--max-tokens", "many"), 2)
    assert "--max-tokens" in other and "edgellm run --help" in other


def test_help_texts() -> None:
    pull = edgellm("pull", "--help").stdout
    assert all(name in pull for name in CATALOG)
    chat = edgellm("chat", "--help").stdout
    assert all(c in chat for c in ("/save", "/load", "/help"))
    run = " ".join(edgellm("run", "--help").stdout.split())
    assert "default: the model's, 256" in run
    serve = " ".join(edgellm("serve", "--help").stdout.split())
    assert "TCP port to listen on (default 8000)" in serve


def test_a_busy_port_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        folder = tmp_path / "model"
        folder.mkdir()  # a folder passes the name check; the port is refused before anything loads
        line = one_line_error(edgellm("serve", str(folder), "--port", str(port)))
    assert f"127.0.0.1:{port}" in line and "--port" in line


def test_chat_help_command() -> None:
    err = io.StringIO()
    repl = ChatRepl(SimpleNamespace(engine=None), None, print, out=io.StringIO(), err=err)
    assert repl.command("/help") is False
    said = err.getvalue()
    assert "/save FILE" in said and "/load FILE" in said and "unknown" not in said


def test_doctor_suggests_repair_only_with_a_channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgellm.doctor import _repair_hint
    from edgellm.store.local import Refs, Store

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    store = Store()
    (store.models / "m" / "versions" / "1").mkdir(parents=True)
    store.write_refs("m", Refs("1", None, None))
    assert "store repair" not in _repair_hint("m@1") and "edgellm rm m@1" in _repair_hint("m@1")
    store.write_refs("m", Refs("1", None, "https://updates.example/m"))
    assert "`edgellm store repair m`" in _repair_hint("m@1")
    assert _repair_hint("smollm2-135m") == ""


def test_run_says_when_a_model_has_no_chat_template(tmp_path: Path) -> None:
    from edgellm.convert.pipeline import convert
    from tests.support.tiny import make_tiny

    make_tiny(tmp_path / "hf", "llama", tied=True)
    art = convert(tmp_path / "hf", tmp_path / "art", quantization="q0f32", progress=False)
    noted = edgellm("run", str(art), "t1 t2", "-n", "2", "--quiet")
    assert noted.returncode == 0 and noted.stderr.count("has no chat template") == 1
    assert "no chat template" not in noted.stdout
    assert "base model" not in noted.stderr and "instruction-tuned" not in noted.stderr  # its tuning is unknown
    raw = edgellm("run", str(art), "t1 t2", "-n", "2", "--quiet", "--raw")
    assert raw.returncode == 0 and "chat template" not in raw.stderr


@pytest.mark.parametrize(("folder", "said"), [("tiny-instruct", "although instruction-tuned (folder name"),
                                              ("tiny-base", "(a base model: folder name")])
def test_the_no_template_note_names_what_the_manifest_says_of_tuning(tmp_path: Path, folder: str, said: str) -> None:
    from edgellm.convert.pipeline import convert
    from tests.support.tiny import make_tiny

    make_tiny(tmp_path / folder, "llama", tied=True)
    art = convert(tmp_path / folder, tmp_path / "art", quantization="q0f32", progress=False)
    noted = edgellm("run", str(art), "t1 t2", "-n", "2", "--quiet")
    assert noted.returncode == 0 and noted.stderr.count(f"has no chat template{', ' if 'although' in said else ' '}"
                                                        f"{said}") == 1, noted.stderr
