"""edgellm/openmp.py: torch's OpenMP threads wait passively in edgellm's processes, and only there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPORT = "import os, json, edgellm.openmp as o; print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), o.PASSIVE]))"


def _run(code: str, **env: str | None) -> list:
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "EDGELLM_OPENMP_PASSIVE")}
    full.update({k: v for k, v in env.items() if v is not None})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=full)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_edgellm_first_makes_openmp_passive() -> None:
    assert _run("import edgellm; " + REPORT) == ["PASSIVE", True]


def test_a_users_policy_torch_loaded_first_or_the_opt_out_win() -> None:
    assert _run("import edgellm; " + REPORT, OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", False]
    assert _run("import torch, edgellm; " + REPORT) == [None, False]
    assert _run("import edgellm; " + REPORT, EDGELLM_OPENMP_PASSIVE="0") == [None, False]
    assert _run("import edgellm; " + REPORT, OMP_WAIT_POLICY="passive") == ["passive", True]


def test_the_llama_cpp_workers_environment_is_the_users() -> None:
    """The benchmark's llama.cpp worker must run llama.cpp's OpenMP team as the user would: no PASSIVE from us,
    in its environment nor set again when the worker imports edgellm."""
    code = ("import json, subprocess, sys; from edgellm.openmp import user_environment; "
            f"print(subprocess.run([sys.executable, '-c', {REPORT!r}], env=user_environment(), "
            "capture_output=True, text=True).stdout)")
    assert _run(code) == [None, False]
    assert _run(code, OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", False]  # the user's own choice goes through
