"""torch's OpenMP threads wait passively between parallel regions in edgellm's processes.

Prefill runs torch's ops (attention, norms) on torch's OpenMP team and its matmuls on the native
library's pool, on the same cores. By default libgomp's idle threads spin after each parallel region,
on the cores the pool's workers need next: with both pools spinning, Qwen2.5-0.5B prefill on 2 threads
ran at 420-633 tok/s through torch's GEMM; with OpenMP waiting passively and the pool's workers sleeping
as soon as a matmul ends, 770-804 tok/s through the native one (SmolLM2: 1586-1660 vs 1558-1649).
libgomp reads OMP_WAIT_POLICY once, when torch loads it, so the package sets it on import, before torch,
unless the user chose a policy, torch came first, or EDGELLM_OPENMP_PASSIVE=0. Children that run another
OpenMP program (the benchmark's llama.cpp worker) get the environment as the user had it, and that opt-out.
"""

from __future__ import annotations

import os
import sys

_VAR, _OPT_OUT = "OMP_WAIT_POLICY", "EDGELLM_OPENMP_PASSIVE"
_SET_HERE = _VAR not in os.environ and "torch" not in sys.modules and os.environ.get(_OPT_OUT) != "0"
if _SET_HERE:
    os.environ[_VAR] = "PASSIVE"

# torch's OpenMP threads sleep between parallel regions in this process (False: torch was loaded before
# edgellm, or the user asked for another policy, and prefill keeps torch's GEMM on more than one thread)
PASSIVE = os.environ.get(_VAR, "").strip().upper() == "PASSIVE" and (_SET_HERE or "torch" not in sys.modules)


def user_environment() -> dict[str, str]:
    """This process's environment without the policy the package set, and telling an edgellm child not to set
    it: for children that run another OpenMP program, whose speed must be its own."""
    env = dict(os.environ)
    if _SET_HERE:
        env.pop(_VAR, None)
    env[_OPT_OUT] = "0"
    return env
