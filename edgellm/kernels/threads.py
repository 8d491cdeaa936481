"""How many threads decode should use by default: the idle physical cores this process may run on.

Decode streams every weight once per token, so a second hyper-thread of a core adds no bandwidth,
and a thread on a core another process keeps busy makes every op wait for its slowest chunk.
The policy: physical cores of the CPU affinity set, minus the cores the 1-minute load average says
are busy (rounded to the nearest core), at least one.
"""

from __future__ import annotations

import os
from pathlib import Path

_TOPOLOGY = Path("/sys/devices/system/cpu")


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int], topology: Path = _TOPOLOGY) -> int:
    """Distinct (package, core) pairs among `cpus`; len(cpus) when the topology is not readable."""
    cores = set()
    for cpu in cpus:
        base = topology / f"cpu{cpu}" / "topology"
        try:
            cores.add(((base / "physical_package_id").read_text().strip(), (base / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def default_threads(load: float | None = None, cpus: set[int] | None = None, topology: Path = _TOPOLOGY) -> int:
    """Idle physical cores of the affinity set (at least 1); `load` defaults to the 1-minute load average."""
    cores = physical_cores(allowed_cpus() if cpus is None else cpus, topology)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    busy = min(cores - 1, int(load + 0.5))
    return max(1, cores - busy)
