"""Several models in one server: each loaded on its first request by name, unloaded after its keep-alive idle.

Every resident model has its own engine and scheduler (serve/queue.py). A model's idle time starts when its last
request ends; after its keep-alive (a request may set it: 0 unloads at once, a negative one keeps it) a reaper
thread unloads it and gives its memory back. Loading another model first makes room within the memory budget —
the `serve --memory-budget`, else the free memory the planner sees — by unloading the least recently used idle
models, or refuses in one line when the busy ones leave too little. Each resident model holds a lease file
(edgellm/leases.py), so `edgellm rm` refuses to delete what a running server holds.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from edgellm import leases
from edgellm.errors import MemoryBudgetError
from edgellm.serve.metrics import Metrics
from edgellm.serve.queue import Scheduler

if TYPE_CHECKING:
    from edgellm.runtime.engine import Engine

log = logging.getLogger("edgellm.serve")
MIB = 1 << 20
DEFAULT_KEEP_ALIVE_S = 300.0  # as Ollama: a model stays five minutes after its last request
REAP_EVERY_S = 1.0
RESERVE_S = 30.0  # how long `reserve` holds a model for a job about to be submitted, at most

# A model name → its artifact folder (pulled and compiled on first use) and the planner's memory estimate.
Locate = Callable[[str], "tuple[Path, int]"]
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
Open = Callable[[str, Path], "Engine"]  # (name, folder) → the loaded engine


@dataclass(frozen=True)
class KeepAlive:
    """How long a model stays loaded after its last request: `seconds`, or None for as long as the server runs."""

    seconds: float | None

    def describe(self) -> str:
        return "until the server stops" if self.seconds is None else f"{self.seconds:g} s"


def parse_keep_alive(value: object) -> KeepAlive:
    """Ollama's keep_alive: a number of seconds or a duration ("5m", "1h30m", "250ms"); negative keeps the model
    loaded; 0 unloads it after the request. Raises ValueError, naming the value, for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"keep_alive must be a number of seconds or a duration such as \"5m\", got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if body and body.replace(".", "", 1).isdigit():
            seconds = sign * float(body)
        else:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a duration (such as \"30s\", \"5m\", \"1h\", \"-1\")")
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        seconds = float(value)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"keep_alive {value!r} is not a finite duration")
    return KeepAlive(None if seconds < 0 else seconds)


@dataclass
class Resident:
    """One loaded model: its engine and scheduler, memory estimate and keep-alive."""

    name: str
    folder: Path
    engine: "Engine"
    scheduler: Scheduler
    size_bytes: int
    load_s: float
    keep_alive: KeepAlive
    last_used: float
    active: int = 0  # requests holding it (acquired, not yet released)
    loaded_at: float = field(default_factory=time.time)
    reserved_until: float = 0.0  # time.monotonic() until which a job about to be submitted holds it

    def reserve(self) -> None:
        """Hold the model for a job its caller is about to submit (until the job shows in its scheduler)."""
        self.reserved_until = time.monotonic() + RESERVE_S

    @property
    def expires_at(self) -> float | None:
        seconds = self.keep_alive.seconds
        return None if seconds is None else self.last_used + seconds

    def busy(self) -> bool:
        return self.active > 0 or not self.scheduler.idle() or time.monotonic() < self.reserved_until


class ModelHost:
    """The resident models of one server, by artifact folder; thread-safe."""

    def __init__(self, locate: Locate, open_model: Open, metrics: Metrics, *, max_queue: int, timeout_s: float,
                 budget: int | None = None, keep_alive: KeepAlive = KeepAlive(DEFAULT_KEEP_ALIVE_S),
                 clock: Callable[[], float] = time.time, max_batch: int | None = None) -> None:
        self.locate = locate
        self.open_model = open_model
        self.metrics = metrics
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.budget = budget
        self.keep_alive = keep_alive
        self.clock = clock
        self.max_batch = max_batch  # rows per decode step (None: every sequence of a model's batch)
        self._residents: dict[Path, Resident] = {}
        self._folders: dict[str, Path] = {}  # names already located
        self._lock = threading.RLock()
        self._loading: dict[Path, threading.Lock] = {}
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # ---- lookups -----------------------------------------------------------------------------------------
    def residents(self) -> list[Resident]:
        with self._lock:
            return sorted(self._residents.values(), key=lambda r: r.loaded_at)

    def find(self, name: str) -> Resident | None:
        """The resident model called `name` (or loaded from the folder that name locates), if any."""
        with self._lock:
            folder = self._folders.get(name)
            return self._residents.get(folder) if folder is not None else None

    # ---- loading -------------------------------------------------------------------------------------------
    def adopt(self, names: tuple[str, ...], engine: "Engine", keep_alive: KeepAlive, load_s: float) -> Resident:
        """Make an engine loaded elsewhere (the server's own model, at startup) resident under `names`."""
        folder = Path(engine.artifact.folder)
        scheduler = self._scheduler(engine)
        resident = Resident(names[0], folder, engine, scheduler, engine.memory.total_bytes, load_s, keep_alive,
                            self.clock())
        with self._lock:
            self._residents[folder] = resident
            self._folders.update({name: folder for name in names})
        leases.take(names[0], folder, resident.expires_at, resident.size_bytes)
        self._start_reaper()
        return resident

    def _scheduler(self, engine: "Engine") -> Scheduler:
        """The engine's queue and batch: as many sequences as its memory plan holds KV caches for."""
        parallel = engine.memory.sequences
        max_batch = min(self.max_batch, parallel) if self.max_batch is not None else None
        return Scheduler(engine, self.metrics, max_queue=self.max_queue, timeout_s=self.timeout_s, parallel=parallel,
                         max_batch=max_batch)

    def load(self, name: str, keep_alive: KeepAlive | None = None) -> Resident:
        """The resident model `name`, loaded first if it is not (blocking: call it off the event loop)."""
        with self._lock:
            known = self._folders.get(name)
            folder = known if known is not None and known in self._residents else None
        need = 0
        if folder is None:
            folder, need = self.locate(name)
            with self._lock:
                self._folders[name] = folder
        with self._lock:
            gate = self._loading.setdefault(folder, threading.Lock())
        with gate:  # one load per folder at a time; others wait for it and share the result
            with self._lock:
                resident = self._residents.get(folder)
                if resident is not None:
                    resident.active += 1
                    if keep_alive is not None:
                        resident.keep_alive = keep_alive
                    return resident
                self._make_room(name, need)
            t0 = time.perf_counter()
            engine = self.open_model(name, folder)
            scheduler = self._scheduler(engine)
            resident = Resident(name, folder, engine, scheduler, engine.memory.total_bytes,
                                time.perf_counter() - t0, keep_alive or self.keep_alive, self.clock(), active=1)
            with self._lock:
                self._residents[folder] = resident
            leases.take(name, folder, resident.expires_at, resident.size_bytes)
            log.info("model %s loaded (%.0f MiB estimated)", name, resident.size_bytes / MIB)
            self._start_reaper()
            return resident

    async def acquire(self, name: str, keep_alive: KeepAlive | None = None) -> Resident:
        """`load` from the event loop; pair it with `release`."""
        return await asyncio.to_thread(self.load, name, keep_alive)

    def release(self, resident: Resident, keep_alive: KeepAlive | None = None) -> None:
        """A request is done with `resident`: its idle time starts now (a keep-alive of 0 unloads it at once)."""
        with self._lock:
            resident.active = max(0, resident.active - 1)
            resident.last_used = self.clock()
            if keep_alive is not None:
                resident.keep_alive = keep_alive
            expired = resident.keep_alive.seconds is not None and resident.keep_alive.seconds <= 0
        if expired and resident.active == 0:
            resident.scheduler.wait_idle(0.5)  # the worker clears its job just after the job's last event
            self.unload(resident.folder, when_idle=True)  # else the reaper unloads it once idle
        elif resident.folder in self._residents:
            leases.take(resident.name, resident.folder, resident.expires_at, resident.size_bytes)

    def _make_room(self, name: str, need: int) -> None:
        """Unload least recently used idle models until `need` bytes fit the budget, or raise MemoryBudgetError."""
        from edgellm.runtime.planner import default_budget

        explicit = self.budget is not None
        while True:
            held = sum(r.size_bytes for r in self._residents.values())
            room = (self.budget - held) if self.budget is not None else default_budget()[0]
            if room is None or need <= room:
                return
            idle = [r for r in self._residents.values() if not r.busy()]
            if not idle:
                where = f"the budget of {self.budget / MIB:.0f} MiB" if self.budget is not None else "the free memory"
                busy = ", ".join(f"{r.name} ({r.size_bytes / MIB:.0f} MiB)" for r in self._residents.values())
                raise MemoryBudgetError(
                    f"loading {name} needs about {need / MIB:.0f} MiB, over {where} left beside the busy models "
                    f"{busy or '(none)'}; retry when they finish")
            victim = min(idle, key=lambda r: r.last_used)
            log.info("unloading %s (least recently used) to make room for %s", victim.name, name)
            self.unload(victim.folder)
            if not explicit:  # the OS may be slow to show the freed pages: count the victim's estimate as freed
                need -= victim.size_bytes

    # ---- unloading -----------------------------------------------------------------------------------------
    def unload(self, folder: Path, *, when_idle: bool = False) -> bool:
        """Unload the model loaded from `folder` and give its memory back; with `when_idle`, only if idle."""
        with self._lock:
            resident = self._residents.get(folder)
            if resident is None or (when_idle and resident.busy()):
                return False
            del self._residents[folder]
        resident.scheduler.close()
        resident.scheduler.join()
        resident.engine.close()
        leases.release(folder)
        log.info("model %s unloaded", resident.name)
        del resident
        gc.collect()  # the weights' mappings close with their last reference
        from edgellm.session.allocator import return_freed_memory

        return_freed_memory()
        return True

    def reap(self) -> list[str]:
        """Unload every idle model whose keep-alive has run out; their names."""
        now = self.clock()
        due: list[Resident] = []
        with self._lock:
            for r in self._residents.values():
                if not r.scheduler.idle():
                    r.reserved_until = 0.0  # the reserved job is in: the scheduler holds the model now
                if r.busy():
                    r.last_used = now  # idle time counts from the end of its last request
                elif r.expires_at is not None and now >= r.expires_at:
                    due.append(r)
        return [r.name for r in due if self.unload(r.folder, when_idle=True)]

    def _start_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None:
                return
            self._reaper = threading.Thread(target=self._reap_loop, name="edgellm-reaper", daemon=True)
            self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_EVERY_S):
            try:
                self.reap()
            except Exception as exc:  # noqa: BLE001 - the reaper must outlive any one failed unload
                log.error("unloading an idle model failed: %s", exc)

    def shutdown(self) -> None:
        """At server shutdown: stop the reaper and every scheduler and drop the leases; the engines stay open
        (the process is ending, and an engine handed in by the caller is the caller's to close)."""
        self._stop.set()
        with self._lock:
            residents, self._residents = list(self._residents.values()), {}
        for resident in residents:
            resident.scheduler.close()
            leases.release(resident.folder)
