"""What the machine is and what it exposes: CPU, versions, peak memory, RAPL energy, thermal zones.

Energy and temperature are read from Linux sysfs (`/sys/class/powercap`, `/sys/class/thermal`); where
the files are absent or unreadable they are reported as unavailable (None), never estimated.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

# The sysfs root; tests point it at a temporary folder.
SYSFS_ROOT = Path("/sys")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - any failure means "not installed"
        return None


def versions() -> dict[str, str | None]:
    """Versions of everything that shapes the numbers."""
    import numpy
    import torch

    return {
        "python": sys.version.split()[0],
        "edgellm": _version("edgellm"),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "llama_cpp_python": _version("llama_cpp_python"),
        "platform": platform.platform(),
    }


def machine_info() -> dict[str, object]:
    """CPU model, core counts, total memory, what the platform exposes for energy and heat, and the
    matmul kernel edgellm uses here."""
    from edgellm.kernels.native import active_kernel

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "cpu_model": cpu_model(),
        "cores_available": cores,
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "rapl_available": bool(rapl_domains()),
        "rapl_domains": [d.name for d in rapl_domains()],
        "thermal_available": read_temperatures() is not None,
        "edgellm_kernel": dict(zip(("name", "why"), active_kernel())),
    }


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far.

    Linux: VmHWM from /proc/self/status — getrusage's ru_maxrss survives exec, so a worker spawned by a
    bigger parent would report the parent's peak — or VmRSS where that is higher (the kernel raises the
    high-water mark lazily: it can trail the current size by a few pages). Elsewhere ru_maxrss (KiB on
    Linux, bytes on macOS).
    """
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        if "VmHWM" in fields:
            return max(int(fields[name].split()[0]) for name in ("VmHWM", "VmRSS") if name in fields) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int | None:
    """Resident set size now (psutil when present, else /proc/self/statm)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# ---- energy (RAPL) --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RaplDomain:
    """One top-level powercap zone (e.g. package-0) with a cumulative energy counter in microjoules."""

    name: str
    energy_file: Path
    max_range_uj: int | None


def rapl_domains() -> list[RaplDomain]:
    """Top-level RAPL zones whose energy counter this process can read; [] when none."""
    base = SYSFS_ROOT / "class" / "powercap"
    if not base.is_dir():
        return []
    domains = []
    for zone in sorted(base.glob("intel-rapl:*")):
        if zone.name.count(":") != 1:  # sub-zones (core, uncore) are already inside the package figure
            continue
        energy = zone / "energy_uj"
        try:
            int(energy.read_text())
        except (OSError, ValueError):
            continue
        name = _read(zone / "name") or zone.name
        max_range = _read(zone / "max_energy_range_uj")
        domains.append(RaplDomain(name, energy, int(max_range) if max_range and max_range.isdigit() else None))
    return domains


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


class EnergyMeter:
    """Joules used between start() and stop() summed over RAPL packages; None where RAPL is unavailable.

    RAPL counts the whole package, so other processes on the machine are included.
    """

    def __init__(self) -> None:
        self.domains = rapl_domains()
        self._start: list[int] = []

    @property
    def available(self) -> bool:
        return bool(self.domains)

    def start(self) -> None:
        self._start = [self._counter(d) for d in self.domains]

    def stop(self) -> float | None:
        if not self.domains or not self._start:
            return None
        total = 0
        for domain, begin in zip(self.domains, self._start):
            delta = self._counter(domain) - begin
            if delta < 0 and domain.max_range_uj:  # the counter wrapped around
                delta += domain.max_range_uj
            total += max(delta, 0)
        return total / 1e6

    @staticmethod
    def _counter(domain: RaplDomain) -> int:
        return int(domain.energy_file.read_text())


# ---- temperature ---------------------------------------------------------------------------------------
def read_temperatures() -> dict[str, float] | None:
    """Degrees Celsius per thermal zone (`type-N` keys); None when the platform exposes none."""
    base = SYSFS_ROOT / "class" / "thermal"
    if not base.is_dir():
        return None
    temps: dict[str, float] = {}
    for zone in sorted(base.glob("thermal_zone*")):
        raw = _read(zone / "temp")
        if raw is None:
            continue
        try:
            millideg = int(raw)
        except ValueError:
            continue
        kind = _read(zone / "type") or "zone"
        temps[f"{kind}-{zone.name.removeprefix('thermal_zone')}"] = millideg / 1000.0
    return temps or None


def max_temperature() -> float | None:
    """The hottest thermal zone now, or None."""
    temps = read_temperatures()
    return max(temps.values()) if temps else None
