"""Progress bars are drawn on a terminal only: captured stderr must not fill with `\\r` frames."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tests.support.tiny import make_tiny

pytest.importorskip("transformers")


def _convert_command(tmp_path: Path, out: str) -> list[str]:
    return [sys.executable, "-m", "edgellm", "convert", str(tmp_path / "hf"), "-o", str(tmp_path / out),
            "--quantization", "q8f16_1"]


def test_captured_stderr_gets_no_progress_frames(tmp_path: Path) -> None:
    make_tiny(tmp_path / "hf", "llama", tied=True)
    done = subprocess.run(_convert_command(tmp_path, "art"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "converting to" not in done.stderr
    assert "wrote" in done.stderr  # the one-line summary is still there


def test_a_terminal_gets_the_bar(tmp_path: Path) -> None:
    make_tiny(tmp_path / "hf", "llama", tied=True)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 0-column terminal gets no bar
    try:
        proc = subprocess.Popen(_convert_command(tmp_path, "art"), stdout=subprocess.DEVNULL, stderr=follower)
        os.close(follower)
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closes when the process exits
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(timeout=300) == 0
    finally:
        os.close(leader)
    assert b"\rconverting to q8f16_1" in seen
