"""kill -9 at random points during `edgellm convert` and `edgellm pull` (issue 16): the next command sees the previous
good state, or a clean state with a one-line error — never a half-written artifact or model file that is accepted.

Each command runs as a subprocess and gets SIGKILL after a delay drawn (with a fixed seed) across its measured run
time; after every kill the state on disk is checked, and a final uninterrupted run must succeed.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from edgellm.catalog import get_entry
from tests.support.tiny import make_tiny

KILLS = 4


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "edgellm.cli", *args]


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


def timed(args: list[str], env: dict[str, str]) -> float:
    t0 = time.monotonic()
    proc = run(args, env)
    assert proc.returncode == 0, proc.stderr
    return time.monotonic() - t0


def kill_after(args: list[str], env: dict[str, str], delay_s: float) -> bool:
    """Start `args`, SIGKILL it after `delay_s`; True if it was still running (so it really was killed)."""
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay_s)
    alive = proc.poll() is None
    if alive:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return alive


def delays(total_s: float, seed: int) -> list[float]:
    """KILLS delays spread over the run (most of the first part is Python importing torch), jittered."""
    rng = random.Random(seed)
    return [total_s * (0.3 + 0.7 * (i + rng.random()) / KILLS) for i in range(KILLS)]


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgellm: error: "), proc.stderr
    return lines[0]


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "EDGELLM_HOME": str(tmp_path / "home"), "PYTHONPATH": str(Path(__file__).parents[2])}


def test_kill_during_convert(tmp_path: Path, env: dict[str, str]) -> None:
    make_tiny(tmp_path / "hf", "llama", tied=False)
    out = tmp_path / "art"
    convert = cli("convert", str(tmp_path / "hf"), "-o", str(out), "-q", "q4f16_1", "--quiet")
    total = timed(convert, env)
    shutil.rmtree(out)
    killed = 0
    for delay in delays(total, seed=16):  # a fresh output folder: after a kill it is absent, or whole
        killed += kill_after(convert, env, delay)
        verify = run(cli("verify", str(out)), env)
        if out.exists():
            assert verify.returncode == 0, verify.stderr  # complete and every sha256 right
            shutil.rmtree(out)
        else:
            assert f"no artifact folder {str(out)!r}" in one_line_error(verify)
    assert killed >= KILLS // 2, "the kills came too late to interrupt the conversion"
    assert run(convert, env).returncode == 0
    forced = [*convert, "--force"]
    for delay in delays(total, seed=17):  # replacing a good artifact: it is always there, old or new
        kill_after(forced, env, delay)
        verify = run(cli("verify", str(out)), env)
        assert verify.returncode == 0, verify.stderr
    assert run(forced, env).returncode == 0
    assert run(cli("verify", str(out)), env).returncode == 0


def _wheel(gguf: Path, folder: Path) -> Path:
    """The catalog's wheel for smollm2-135m rebuilt locally (stored, not compressed) from the pulled GGUF."""
    member = get_entry("smollm2-135m").members[0]
    path = folder / f"{member.package.replace('-', '_')}-{member.version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.write(gguf, member.member)
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def test_kill_during_pull(smollm2_gguf: Path, tmp_path: Path, env: dict[str, str]) -> None:
    """Pull extracts from a cached wheel (no network: the wheel is already in the downloads folder)."""
    entry = get_entry("smollm2-135m")
    wheel = _wheel(smollm2_gguf, tmp_path)
    downloads = Path(env["EDGELLM_HOME"]) / "downloads" / entry.name
    final = Path(env["EDGELLM_HOME"]) / "sources" / entry.name / entry.filename
    pull = cli("pull", entry.name, "--quiet")

    def stage(fresh: bool) -> None:
        downloads.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, downloads / wheel.name)
        if fresh:
            final.unlink(missing_ok=True)
            final.with_name(final.name + ".sha256").unlink(missing_ok=True)

    stage(fresh=True)
    total = timed(pull, env)
    for i, delay in enumerate(delays(total, seed=18)):
        fresh = i % 2 == 0  # alternate: nothing pulled yet, and --force over a good file
        stage(fresh)
        kill_after(pull if fresh else [*pull, "--force"], env, delay)
        if final.exists():  # only ever renamed into place after its sha256 was checked
            assert final.stat().st_size == entry.size and _sha256(final) == entry.sha256
        else:
            assert fresh
        proc = run(pull if fresh else [*pull, "--force"], env)  # the same command again finishes the job
        assert proc.returncode == 0, proc.stderr
        assert _sha256(final) == entry.sha256
        assert not list(final.parent.glob(f".{final.name}.*.part"))
