"""The `.NAME.<random>.partial` folders an interrupted conversion leaves (issue 29, finding 13): the next conversion to
NAME removes those no running process writes, and never one that a live conversion holds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgellm.convert.pipeline import convert
from tests.support.tiny import make_tiny

REPO = Path(__file__).parents[2]
DAY = 24 * 3600

# A conversion in progress: a partial folder for OUT held by this child until it is killed.
HOLD = """
import sys, time
from pathlib import Path
from edgellm.convert.partial import PartialFolder
partial = PartialFolder(Path(sys.argv[1]))
(partial.path / "weights-00001.safetensors").write_bytes(b"x")
print(partial.path, flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("partial") / "hf"
    make_tiny(folder, "llama", tied=True)
    return folder


def _partials(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _holder(out: Path) -> tuple[subprocess.Popen[str], Path]:
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True,
                             env=os.environ | {"PYTHONPATH": str(REPO)})
    assert child.stdout is not None
    return child, Path(child.stdout.readline().strip())


def test_an_interrupted_conversion_is_cleaned_by_the_next(hf: Path, tmp_path: Path) -> None:
    """A partial folder from an edgellm without locks, unchanged for more than a day, and one whose converter was
    killed (its lock free): both removed by the next conversion to the same name, nothing else touched."""
    out = tmp_path / "art"
    old = tmp_path / ".art.k3j2h1.partial"
    old.mkdir()
    (old / "weights-00001.safetensors").write_bytes(b"x" * 100)
    os.utime(old, (time.time() - 2 * DAY, time.time() - 2 * DAY))
    child, killed = _holder(out)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert killed.is_dir() and killed.with_name(killed.name + ".lock").is_file()
    other = tmp_path / ".other.abc.partial"  # another output's: not this conversion's to judge
    other.mkdir()
    os.utime(other, (time.time() - 2 * DAY, time.time() - 2 * DAY))
    convert(hf, out, quantization="q0f32", progress=False)
    assert _partials(out) == []
    assert other.is_dir() and (out / "manifest.json").is_file()


def test_a_live_conversion_is_never_touched(hf: Path, tmp_path: Path) -> None:
    """While a process holds its partial folder, another conversion to the same name leaves it alone (however old
    the folder looks); once that process dies, the folder goes."""
    from edgellm.convert.partial import remove_stale

    out = tmp_path / "art"
    child, live = _holder(out)
    try:
        os.utime(live, (time.time() - 2 * DAY, time.time() - 2 * DAY))
        convert(hf, out, quantization="q0f32", progress=False)
        assert live.is_dir() and (live / "weights-00001.safetensors").is_file()
        assert remove_stale(out) == []
    finally:
        child.kill()
        child.wait()
    assert remove_stale(out) == [live]
    assert _partials(out) == []


def test_a_recent_unlocked_partial_folder_is_kept(tmp_path: Path) -> None:
    """Without a lock file only the age tells: a folder changed within the day may belong to a running
    conversion of an older edgellm, and stays."""
    from edgellm.convert.partial import STALE_AFTER, remove_stale

    out = tmp_path / "art"
    recent = tmp_path / ".art.q1w2e3.partial"
    recent.mkdir()
    assert remove_stale(out) == []
    assert remove_stale(out, now=time.time() + STALE_AFTER + 60) == [recent]
