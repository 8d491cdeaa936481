"""`edgellm doctor`: is this machine ready to run edgellm, and is every installed model intact?

Prints one section per area (software, CPU and kernels, disk, models, telemetry); every problem found
is also one line at the end. Exit 0 when healthy, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

MIN_FREE_DISK = 1 << 30
_X86_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                 "amx_tile", "amx_int8", "amx_bf16")
_ARM_FEATURES = ("asimd", "asimddp", "i8mm", "bf16", "sve", "sve2")
_MIB = 2**20


@dataclass
class Checkup:
    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def add(self, section: str, key: str, value: str) -> None:
        self.sections.setdefault(section, []).append((key, value))

    def problem(self, section: str, key: str, message: str) -> None:
        self.add(section, key, f"PROBLEM: {message}")
        self.problems.append(message)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_software(c: Checkup) -> None:
    from edgellm import __version__

    c.add("software", "edgellm", __version__)
    c.add("software", "python", platform.python_version())
    if sys.version_info < (3, 11):
        c.problem("software", "python", f"Python {platform.python_version()} is older than 3.11")
    for dist, why in (("torch", "the runtime"), ("xgrammar", "structured output"), ("tokenizers", "tokenizers"),
                      ("safetensors", "weights"), ("cryptography", "signed updates")):
        v = _version(dist)
        if v is None:
            c.problem("software", dist, f"{dist} is not installed ({why}); reinstall edgellm")
        else:
            c.add("software", dist, v)


def cpu_features() -> list[str]:
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.split(":")[0].strip() in ("flags", "Features"):
                flags.update(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return [f for f in (*_X86_FEATURES, *_ARM_FEATURES) if f in flags]


def check_cpu(c: Checkup) -> None:
    import torch

    from edgellm.errors import EdgeLLMError
    from edgellm.quant.dispatch import select_kernel
    from edgellm.kernels.threads import default_threads
    from edgellm.telemetry.events import device_class

    c.add("cpu", "device class", device_class())
    c.add("cpu", "features", " ".join(cpu_features()) or "(not readable on this system)")
    c.add("cpu", "torch capability", torch.backends.cpu.get_cpu_capability())
    try:
        import edgellm.kernels  # noqa: F401 - native kernels, when this build has them
        native = "available"
    except ImportError:
        native = "not built (torch kernels are used)"
    c.add("cpu", "native kernels", native)
    for fmt in ("q4", "q8", "f16"):
        try:
            c.add("cpu", f"{fmt} matmul kernel", select_kernel(fmt).name)
        except EdgeLLMError as exc:
            c.problem("cpu", f"{fmt} matmul kernel", str(exc))
    c.add("cpu", "threads", f"{default_threads()} (cores this process may use; torch uses {torch.get_num_threads()})")


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, else None."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_disk(c: Checkup) -> None:
    from edgellm.paths import edgellm_home

    home = edgellm_home()
    free = shutil.disk_usage(_existing(home)).free
    c.add("disk", "EDGELLM_HOME", str(home))
    c.add("disk", "free", f"{free / 2**30:.1f} GiB")
    if free < MIN_FREE_DISK:
        c.problem("disk", "free", f"only {free / _MIB:.0f} MiB free under {home}; updates and conversions need room")


def installed_models() -> list[tuple[str, Path]]:
    """(label, folder) of every stored version and every compiled catalog artifact."""
    from edgellm.paths import artifacts_dir
    from edgellm.store.local import Store

    store = Store()
    found = []
    for name in store.names():
        refs = store.refs(name)
        for v in store.versions(name):
            tag = " (current)" if v == refs.current else " (previous)" if v == refs.previous else ""
            found.append((f"{name}@{v}{tag}", store.version_dir(name, v)))
    cache = artifacts_dir()
    if cache.is_dir():
        found += [(p.name, p) for p in sorted(cache.iterdir()) if (p / "manifest.json").is_file()]
    return found


def _repair_hint(label: str) -> str:
    """`store repair NAME` fetches a stored version again from its channel: suggested only when one is known."""
    if "@" not in label:
        return ""
    from edgellm.store.local import Store

    name = label.split("@")[0]
    try:
        channel = Store().refs(name).channel
    except Exception:  # noqa: BLE001 - an unreadable refs.json: no channel known
        channel = None
    if channel:
        return f"; `edgellm store repair {name}` fetches it again"
    return f"; no update channel is known for {name}: `edgellm rm {label}` deletes it"


def check_models(c: Checkup, quick: bool) -> None:
    from edgellm.artifact.reader import open_artifact
    from edgellm.errors import EdgeLLMError
    from edgellm.runtime.memory import estimate_memory

    models = installed_models()
    free = available_memory()
    c.add("models", "memory available", f"{free / _MIB:.0f} MiB" if free is not None else "unknown")
    if not models:
        c.add("models", "installed", "none yet (`edgellm pull`, `edgellm run NAME` or `edgellm update`)")
    for label, folder in models:
        try:
            art = open_artifact(folder, verify=not quick)
        except EdgeLLMError as exc:
            fix = _repair_hint(label)
            c.problem("models", label, f"{label}: {exc}{fix}")
            continue
        mem = estimate_memory(art.config, art.config.context_window)
        checked = "sizes ok" if quick else "sha256 ok"
        line = (f"{checked}, {art.manifest.total_bytes / _MIB:.1f} MiB on disk, needs about "
                f"{mem.total_bytes / _MIB:.0f} MiB at {art.config.context_window} tokens")
        if free is not None and mem.total_bytes > free:
            c.problem("models", label, f"{label} needs about {mem.total_bytes / _MIB:.0f} MiB but only "
                                       f"{free / _MIB:.0f} MiB is available (a smaller --context-window helps)")
        else:
            c.add("models", label, line)


def check_telemetry(c: Checkup) -> None:
    from edgellm.store.trust import trusted_keys
    from edgellm.telemetry import sink
    from edgellm.telemetry.settings import load_settings

    s = load_settings()
    st = sink.stats()
    c.add("telemetry", "state", f"{'on' if s.enabled else 'off'} (level {s.level}, sample rate {s.sample_rate:g}), "
                                f"{st['events']} events stored, {st['pending_upload']} not uploaded")
    c.add("telemetry", "trusted update keys", str(len(trusted_keys())))


def run_checks(quick: bool = False) -> Checkup:
    from edgellm.errors import EdgeLLMError

    c = Checkup()
    for check in (check_software, check_cpu, check_disk, lambda x: check_models(x, quick), check_telemetry):
        try:
            check(c)
        except EdgeLLMError as exc:  # one broken area (e.g. an unreadable settings file) is one problem
            c.problems.append(str(exc))
    return c


def cmd_doctor(args: argparse.Namespace) -> int:
    c = run_checks(quick=args.quick)
    if args.json:
        print(json.dumps({"sections": {k: dict(v) for k, v in c.sections.items()}, "problems": c.problems}, indent=2))
    else:
        for section, rows in c.sections.items():
            print(f"[{section}]")
            width = max(len(k) for k, _ in rows)
            for key, value in rows:
                print(f"  {key:<{width}}  {value}")
        print("healthy" if not c.problems else f"{len(c.problems)} problem(s):")
    for problem in c.problems:
        print(f"edgellm: problem: {problem}", file=sys.stderr)
    return 1 if c.problems else 0


def add_doctor_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    help = "check versions, CPU features and kernels, disk, every installed model, telemetry; exit 1 on problems"
    p = sub.add_parser("doctor", help=help, description=help, parents=[common])
    p.add_argument("--quick", action="store_true", help="check model file sizes only, not their sha256")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
