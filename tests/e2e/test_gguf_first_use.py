"""`edgellm run/serve/info x.gguf` compile a GGUF file on first use (one resolve path: edgellm/resolve.py), cached
under the file's sha256, with a progress line on a terminal only; the second use reuses the artifact; a changed
file compiles again. (`info` stands for them here: the tiny GGUF's vocabulary has no token for typed text.)"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgellm.catalog import get_entry

transformers = pytest.importorskip("transformers")
pexpect = pytest.importorskip("pexpect")

from tests.families.test_families import _make, _qwen3  # noqa: E402
from tests.convert.test_families_gguf import _write_gguf  # noqa: E402


def _gguf(path: Path, seed: int) -> Path:
    import torch

    model = _make(path.parent / f"hf{seed}", _qwen3)
    if seed:
        with torch.no_grad():
            next(model.parameters()).add_(seed)
    _write_gguf(model, "qwen3", path)
    return path


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)


def test_run_compiles_a_gguf_on_first_use(tmp_path: Path, home: Path) -> None:
    gguf = _gguf(tmp_path / "tiny.gguf", 0)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    first = run("info", str(gguf), "--json")
    assert first.returncode == 0, first.stderr
    [art] = list((home / "artifacts").iterdir())
    assert art.name == f"tiny-{digest[:12]}-source"  # what `convert tiny.gguf` gives it: the file's own bits
    converted = run("convert", str(gguf), "-o", str(tmp_path / "converted"))
    assert converted.returncode == 0, converted.stderr
    shown = [run("info", str(p), "--json").stdout for p in (art, tmp_path / "converted")]
    assert json.loads(shown[0])["quantization"] == json.loads(shown[1])["quantization"] == "source"
    assert "compiling" not in first.stderr  # captured output: no progress line
    stamp = art.stat().st_mtime_ns
    again = run("info", str(gguf), "--json")
    assert again.returncode == 0 and again.stdout == first.stdout
    assert [p.name for p in (home / "artifacts").iterdir()] == [art.name] and art.stat().st_mtime_ns == stamp
    _gguf(gguf, 1)  # the same path, other weights: compiled again under the new hash
    changed = run("info", str(gguf), "--json", "-q", "q0f32")
    assert changed.returncode == 0, changed.stderr
    new = hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert (home / "artifacts" / f"tiny-{new[:12]}-q0f32").is_dir()


def test_a_terminal_gets_one_progress_line(tmp_path: Path, home: Path) -> None:
    gguf = _gguf(tmp_path / "tiny.gguf", 0)
    child = pexpect.spawn(sys.executable, ["-m", "edgellm", "info", str(gguf)],
                          env=dict(os.environ), encoding="utf-8", timeout=300)
    child.expect(r"compiling tiny\.gguf to source on first use")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


SMOLLM2 = Path.home() / ".cache/edgellm/sources/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not SMOLLM2.is_file(), reason="the SmolLM2 GGUF is not pulled here")
def test_run_the_catalogs_own_file_gets_the_catalogs_scheme(home: Path) -> None:
    """One command, the real file: compiled at the scheme the catalog gives the same bytes, then answered."""
    proc = run("run", str(SMOLLM2), "What is the capital of France?", "-n", "12", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()  # what it says is the greedy reply, which a near-tie decides (test_reference_gguf)
    [art] = list((home / "artifacts").iterdir())
    assert art.name.endswith(f"-{get_entry('smollm2-135m').default_scheme}")
