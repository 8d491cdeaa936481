"""Running the measurement jobs: a process pool on this machine, or a Ray cluster of test devices.

Locally, quality and task jobs run in parallel first; then speed jobs run one at a time, alone, so they do
not disturb each other. With Ray, every node is tagged with a custom resource ``edgellm_device:<class>``
(``ray start --resources '{"edgellm_device:phone-8gb": 1}'``); each device class measures every job on one
of its own nodes, one job per node at a time, and the results come back per device class.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, Callable, Iterable

from edgellm.errors import EdgeLLMError
from edgellm.select.candidates import Candidate
from edgellm.select.constraints import Method
from edgellm.select.measure import Job, Kind, run_job

DEVICE_RESOURCE = "edgellm_device:"
Results = dict[str, dict[Job, dict[str, Any]]]  # device class -> job -> result


class Progress:
    """A bar with ETA on a terminal (edgellm/progress.py), naming the measurement under way; nothing in captured
    output."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        from edgellm.progress import bar

        self.bar = bar(total=total, enabled=enabled and total > 0, desc=label, unit="job")

    def start(self, job: Job) -> None:
        """Name a job as it starts (the first one may take many seconds before any count moves)."""
        self.bar.set_postfix_str(f"{job.kind} {job.candidate.id}"[:48])

    def step(self, note: str) -> None:
        self.bar.set_postfix_str(note[:48])
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _over(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _skipped(job: Job) -> dict[str, Any]:
    return {"kind": job.kind, "error": "not measured: the --max-time budget ran out", "cached": False}


def run_local(jobs: list[Job], device_class: str, *, workers: int = 2, max_time_s: float | None = None,
              use_cache: bool = True, progress: bool = True) -> Results:
    """Quality/task jobs in a process pool, then speed jobs one by one; every result lands in the cache."""
    deadline = None if max_time_s is None else time.monotonic() + max_time_s
    results: dict[Job, dict[str, Any]] = {}
    parallel = [j for j in jobs if j.kind != "speed"]
    serial = [j for j in jobs if j.kind == "speed"]
    bar = Progress(len(jobs), f"select ({device_class})", progress)
    try:
        if parallel:
            with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
                pending: dict[Future[dict[str, Any]], Job] = {}
                queue = list(parallel)
                while queue or pending:
                    while queue and len(pending) < workers and not _over(deadline):
                        job = queue.pop(0)
                        bar.start(job)
                        pending[pool.submit(run_job, job, device_class, use_cache)] = job
                    if not pending:
                        break
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        job = pending.pop(future)
                        results[job] = future.result()
                        bar.step(job.candidate.id)
                for job in queue:
                    results[job] = _skipped(job)
        for job in serial:
            bar.start(job)
            results[job] = _skipped(job) if _over(deadline) else run_job(job, device_class, use_cache)
            bar.step(job.candidate.id)
    finally:
        bar.close()
    return {device_class: results}


def device_classes(resources: dict[str, float]) -> list[str]:
    """The device classes a Ray cluster offers (its edgellm_device:<class> resources)."""
    return sorted(k[len(DEVICE_RESOURCE):] for k in resources if k.startswith(DEVICE_RESOURCE))


def run_ray(jobs: list[Job], address: str, *, use_cache: bool = True, init_kwargs: dict[str, Any] | None = None,
            job_fn: Callable[[Job, str, bool], dict[str, Any]] = run_job, progress: bool = True) -> Results:
    """Every job on every device class of the cluster at `address` ("auto", "ray://host:10001", ...).

    `job_fn(job, device_class, use_cache)` runs on the node (default: the real measurement)."""
    try:
        import ray
    except ImportError:
        raise EdgeLLMError("--ray needs the ray extra: pip install -e '.[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, **(init_kwargs or {}))
    classes = device_classes(ray.cluster_resources())
    if not classes:
        raise EdgeLLMError(f"the Ray cluster at {address} has no node tagged with a {DEVICE_RESOURCE}<class> "
                           "resource; start nodes with ray start --resources '{\"edgellm_device:NAME\": 1}'")
    remote = ray.remote(job_fn)
    refs: dict[Any, tuple[str, Job]] = {}
    for cls in classes:
        for job in jobs:
            ref = remote.options(resources={DEVICE_RESOURCE + cls: 1}, num_cpus=0).remote(job, cls, use_cache)
            refs[ref] = (cls, job)
    results: Results = {cls: {} for cls in classes}
    bar = Progress(len(refs), f"select on {len(classes)} device classes", progress)
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            cls, job = refs[done[0]]
            results[cls][job] = ray.get(done[0])
            bar.step(f"{cls}: {job.candidate.id}")
    finally:
        bar.close()
    return results


def jobs_for(candidates: Iterable[Candidate], method: Method, *, speed: bool, quality: bool, task: bool) -> list[Job]:
    """The jobs the constraints need: speed per candidate, quality/task once per distinct weights."""
    jobs: list[Job] = []
    seen: set[tuple[str, Any]] = set()
    for cand in candidates:
        if speed:
            jobs.append(Job("speed", cand, method))
        once: tuple[tuple[Kind, bool], ...] = (("quality", quality), ("task", task and cand.backend == "edgellm"))
        for kind, wanted in once:
            if wanted and (kind, cand.weights) not in seen:
                seen.add((kind, cand.weights))
                jobs.append(Job(kind, cand, method))
    return jobs
