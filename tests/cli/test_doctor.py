"""`edgellm doctor`: healthy exits 0; each problem is one line and exit 1 (a modified model, low disk, low memory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgellm import doctor
from edgellm.cli import main
from edgellm.convert.pipeline import convert
from edgellm.store.local import Store
from tests.support.tiny import make_tiny


@pytest.fixture
def stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    make_tiny(tmp_path / "hf", "llama", tied=True)
    art = convert(tmp_path / "hf", tmp_path / "art", quantization="q8f16_1", progress=False)
    folder = Store().add_folder(art, "tiny", "1").folder
    Store().activate("tiny", "1")
    return folder


def problems(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_healthy(stored: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "tiny@1" in out and "sha256 ok" in out and out.rstrip().endswith("healthy")
    assert "q4 matmul kernel" in out and "telemetry" in out


def test_modified_model_is_one_line(stored: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = stored / "weights-00002.safetensors"
    os.chmod(shard, 0o644)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["doctor", "--quick"]) == 0  # sizes only: a same-size change is invisible
    capsys.readouterr()
    assert main(["doctor"]) == 1
    (line,) = problems(capsys)
    assert line.startswith("edgellm: problem: tiny@1") and "weights-00002.safetensors fails its xxh3" in line
    shard.write_bytes(bytes(data[:-10]))
    assert main(["doctor", "--quick"]) == 1
    (line,) = problems(capsys)
    assert "truncated or replaced" in line


def test_low_disk_and_memory(stored: Path, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "MIN_FREE_DISK", 1 << 62)
    monkeypatch.setattr(doctor, "available_memory", lambda: 1 << 20)
    assert main(["doctor", "--quick"]) == 1
    lines = problems(capsys)
    assert len(lines) == 2
    assert "MiB free under" in lines[0] and "tiny@1 (current) needs about" in lines[1]
