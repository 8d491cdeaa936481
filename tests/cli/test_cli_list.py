"""`edgellm list`, `ps`, `rm` and `--version` on an EDGELLM_HOME of their own: every kind of entry with its size
(checked against os.walk), rm's refusals (a folder a live server holds, a current store version) and a crashed
server's lease, which blocks nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgellm.convert.pipeline import convert
from tests.support.tiny import make_tiny


@pytest.fixture(scope="module")
def tiny_art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    make_tiny(root / "hf", "llama", tied=True)
    return convert(root / "hf", root / "art", quantization="q0f32", progress=False)


@pytest.fixture
def home(tmp_path: Path, tiny_art: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home with a compiled artifact, two store versions, a pulled source and a downloads folder."""
    home = tmp_path / "home"
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    shutil.copytree(tiny_art, home / "artifacts" / "mine")
    (home / "sources" / "smollm2-135m").mkdir(parents=True)
    (home / "sources" / "smollm2-135m" / "model.gguf").write_bytes(b"g" * 5000)
    (home / "downloads" / "smollm2-135m").mkdir(parents=True)
    (home / "downloads" / "smollm2-135m" / "x.whl").write_bytes(b"w" * 3000)
    from edgellm.store.local import Store

    store = Store()
    store.add_folder(tiny_art, "tiny", "1")
    store.add_folder(tiny_art, "tiny", "2")
    store.activate("tiny", "2")
    return home


def edgellm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120)


def walked(path: Path) -> int:
    return sum((Path(d) / f).stat().st_size for d, _, files in os.walk(path) for f in files)


def test_version() -> None:
    from edgellm import __version__

    proc = edgellm("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"edgellm {__version__}"


def test_list_shows_every_kind_with_sizes(home: Path) -> None:
    proc = edgellm("list", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["name"], r["kind"]): r for r in json.loads(proc.stdout)}
    mine = home / "artifacts" / "mine"
    assert set(rows) == {(str(mine), "artifact"), ("tiny@1", "stored"), ("tiny@2", "stored"),
                         ("smollm2-135m", "source"), ("smollm2-135m", "download")}
    assert rows[(str(mine), "artifact")]["size_bytes"] == walked(mine)
    assert rows[(str(mine), "artifact")]["scheme"] == "q0f32"
    assert rows[("smollm2-135m", "source")]["size_bytes"] == 5000
    assert rows[("smollm2-135m", "download")]["size_bytes"] == 3000
    assert rows[("tiny@2", "stored")]["current"] and not rows[("tiny@1", "stored")]["current"]
    table = edgellm("list")
    assert table.returncode == 0 and "tiny@2" in table.stdout and "stored*" in table.stdout


def test_rm_removes_and_refuses(home: Path) -> None:
    proc = edgellm("rm", "tiny@2")
    assert proc.returncode == 1 and "current version" in proc.stderr and proc.stderr.count("\n") == 1
    proc = edgellm("rm", "tiny@1")
    assert proc.returncode == 0 and not (home / "store" / "models" / "tiny" / "versions" / "1").exists()
    proc = edgellm("rm", "smollm2-135m")
    assert proc.returncode == 1 and "--sources" in proc.stderr
    proc = edgellm("rm", "smollm2-135m", "--sources")
    assert proc.returncode == 0 and not (home / "sources" / "smollm2-135m").exists()
    assert not (home / "downloads" / "smollm2-135m").exists()
    proc = edgellm("rm", "nothing-here")
    assert proc.returncode == 1 and "edgellm list" in proc.stderr and "Traceback" not in proc.stderr


def test_rm_refuses_what_a_live_server_holds_and_ps_shows_it(home: Path) -> None:
    mine = home / "artifacts" / "mine"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from edgellm import leases; "
         f"leases.take('mine', Path({str(mine)!r}), time.time() + 600, 12345678); print('held', flush=True); "
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = edgellm("rm", str(mine))
        assert proc.returncode == 1 and f"pid {holder.pid}" in proc.stderr and mine.is_dir()
        ps = edgellm("ps", "--json")
        [row] = json.loads(ps.stdout)
        assert row["pid"] == holder.pid and row["size_bytes"] == 12345678 and row["expires_at"] > time.time()
        assert "idle unload in" in edgellm("ps").stdout
    finally:
        holder.kill()  # a crash: its lease file stays behind
        holder.wait()
    assert list((home / "leases").glob("*.json"))
    proc = edgellm("rm", str(mine))  # the dead server's lease blocks nothing
    assert proc.returncode == 0 and not mine.exists()
    assert not list((home / "leases").glob("*.json"))
    assert "No models loaded" in edgellm("ps").stderr
