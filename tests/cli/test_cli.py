"""The CLI: stdout carries only the answer; every bad input is one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgellm.convert.pipeline import convert
from tests.support.tiny import make_tiny


def edgellm(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, input=stdin, timeout=600)


def assert_one_line_error(proc: subprocess.CompletedProcess, pattern: str) -> None:
    import re

    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("edgellm: error: "), lines[0]
    assert re.search(pattern, lines[0]), lines[0]
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    make_tiny(root / "hf", "llama", tied=True)
    return convert(root / "hf", root / "art", quantization="q8f16_1", progress=False)


def test_unknown_model_name() -> None:
    assert_one_line_error(edgellm("run", "no-such-model", "hi"), r"no such model 'no-such-model'.*smollm2-135m")


def test_missing_file_and_folder(tmp_path: Path) -> None:
    assert_one_line_error(edgellm("convert", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "o")),
                          "no such file or folder")
    assert_one_line_error(edgellm("info", str(tmp_path / "nope/")), "no artifact folder")


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"architectures": ["MambaForCausalLM"]}')
    assert_one_line_error(edgellm("convert", str(tmp_path / "m"), "-o", str(tmp_path / "o")),
                          "MambaForCausalLM is not supported")


def test_not_a_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf at all" * 10)
    assert_one_line_error(edgellm("convert", str(bogus), "-o", str(tmp_path / "o")), "not a readable GGUF")


def test_corrupted_shard(tiny_artifact: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(tiny_artifact, tmp_path / "broken"))
    shard = broken / "weights-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 1
    shard.write_bytes(bytes(data))
    assert_one_line_error(edgellm("run", str(broken), "t1 t2"), "weights-00001.safetensors fails its xxh3")
    assert_one_line_error(edgellm("verify", str(broken)), "fails its sha256")


def test_prompt_longer_than_context(tiny_artifact: Path) -> None:
    proc = edgellm("run", str(tiny_artifact), "--raw", "--context-window", "16", " ".join(["t5"] * 40))
    assert_one_line_error(proc, "prompt is 40 tokens but the context window is 16 tokens")


def test_run_prints_only_generated_text(tiny_artifact: Path) -> None:
    proc = edgellm("run", str(tiny_artifact), "--raw", "t1 t2 t3", "--max-tokens", "5", "--temperature", "0",
                   "--stats", "--quiet")
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert 1 <= len(words) <= 5 and all(w.startswith("t") or w in ("<s>", "</s>") for w in words), proc.stdout
    assert "decode" in proc.stderr and "tok/s" in proc.stderr


def test_run_reads_prompt_from_stdin(tiny_artifact: Path) -> None:
    a = edgellm("run", str(tiny_artifact), "--raw", "-", "-n", "4", "--temperature", "0", stdin="t1 t2 t3")
    b = edgellm("run", str(tiny_artifact), "--raw", "t1 t2 t3", "-n", "4", "--temperature", "0")
    assert a.returncode == 0 and a.stdout == b.stdout


def test_info_and_verify(tiny_artifact: Path) -> None:
    proc = edgellm("info", str(tiny_artifact))
    assert proc.returncode == 0, proc.stderr
    for needle in ("parameters", "bits per parameter", "size on disk", "estimated memory", "q8f16_1"):
        assert needle in proc.stdout
    proc = edgellm("verify", str(tiny_artifact))
    assert proc.returncode == 0 and proc.stdout.startswith("ok: 5 files")  # 3 shards (global + 2 layers), tokenizer, config


def test_chat_repl_commands(tiny_artifact: Path, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    make_tiny(hf, "qwen2", tied=False)
    (hf / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t9{% endif %}")
    art = convert(hf, tmp_path / "art", quantization="q0f32", progress=False)
    proc = edgellm("chat", str(art), "-n", "3", "--temperature", "0", stdin="t1 t2\n/stats\n/reset\n/bogus\nt3\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "decode" in proc.stderr and "(conversation cleared)" in proc.stderr and "unknown command /bogus" in proc.stderr
    assert "Traceback" not in proc.stderr


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the parser (`eval quality`, `serve`, ...), found by walking its subparsers."""
    out = []
    for action in parser._actions:  # argparse has no public accessor for its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*path, name))
                out.extend(_subcommands(sub, (*path, name)))
    return out


def test_help_explains_every_command() -> None:
    """Each command, found from the parser itself (a new one is covered automatically), has a help line in
    its parent's listing and a working --help."""
    from edgellm.cli import build_parser

    paths = _subcommands(build_parser())
    assert {("eval",), ("serve",), ("run",), ("convert",)} <= set(paths)
    top = edgellm("--help")
    assert top.returncode == 0
    for path in paths:
        proc = edgellm(*path, "--help")
        assert proc.returncode == 0 and proc.stdout.startswith("usage: edgellm " + " ".join(path)), path
        parent = edgellm(*path[:-1], "--help").stdout if len(path) > 1 else top.stdout
        lines = parent.splitlines()
        at = next((i for i, ln in enumerate(lines) if ln.split()[:1] == [path[-1]]), None)
        assert at is not None, f"{path} is not listed in its parent's --help"
        # argparse puts the help after the name, or on the next line when the name is wider than its column
        help_text = lines[at].split(maxsplit=1)[1:] or lines[at + 1].split()
        assert help_text, f"{path} has no help line in its parent's --help"
    assert "smollm2-135m" in edgellm("run", "--help").stdout
