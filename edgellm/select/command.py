"""`edgellm select`: arguments and the run — expand, measure (cached), decide, report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgellm.errors import EdgeLLMError

EPILOG = """\
The constraints file (TOML) names the candidate space, the measurement method, the limits and the
ranking weights; docs/selection.md has a worked example. Results are cached under
$EDGELLM_HOME/select/cache keyed by weights hash + settings + edgellm version, so a rerun measures only
what changed, and Ctrl-C keeps what was finished.
Examples:
  edgellm select --constraints device.toml
  edgellm select --constraints device.toml --json out.json --png out.png --max-time 1800
  edgellm select --constraints device.toml --ray auto        # one table per device class of the cluster"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--constraints", "-c", required=True, metavar="FILE", help="constraints file (TOML)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the whole decision as JSON")
    p.add_argument("--png", default=None, metavar="FILE", help="write the latency/quality chart")
    p.add_argument("--max-time", type=float, default=None, metavar="SECONDS",
                   help="stop starting new measurements after this long (the rest are rows marked not measured)")
    p.add_argument("--workers", type=int, default=2, help="parallel quality/task jobs (speed runs alone; default 2)")
    p.add_argument("--no-cache", action="store_true", help="measure everything again (results still refresh the cache)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="measure on a Ray cluster (auto, or ray://host:port): each node tagged "
                        "edgellm_device:<class> measures for its class (needs the ray extra)")


def _llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    from edgellm.select.candidates import expand
    from edgellm.select.constraints import QUALITY_METRICS, SPEED_METRICS, TASK_METRICS, load_constraints
    from edgellm.select.decide import pick, rows_for
    from edgellm.select.executor import jobs_for, run_local, run_ray
    from edgellm.select.report import as_json, table, write_json, write_png

    constraints = load_constraints(args.constraints)
    if args.workers < 1 or (args.max_time is not None and args.max_time <= 0):
        raise EdgeLLMError("--workers must be >= 1 and --max-time > 0")
    candidates, skipped = expand(constraints.space, llama_cpp_available=_llama_cpp_available())
    jobs = jobs_for(candidates, constraints.method, speed=constraints.needs(SPEED_METRICS),
                    quality=constraints.needs(QUALITY_METRICS),
                    task=constraints.needs(TASK_METRICS) and constraints.method.task_items > 0)
    print(f"{len(candidates) + len(skipped)} candidates, {len(jobs)} measurements", file=sys.stderr)
    if args.ray:
        results = run_ray(jobs, args.ray, use_cache=not args.no_cache, progress=not args.quiet)
    else:
        results = run_local(jobs, constraints.device_class, workers=args.workers, max_time_s=args.max_time,
                            use_cache=not args.no_cache, progress=not args.quiet)
    decided = {}
    for cls, by_job in results.items():
        rows = rows_for(constraints, candidates, skipped, by_job)
        best, reason = pick(rows, [*dict.fromkeys([lim.metric for lim in constraints.limits] + list(constraints.weights))])
        decided[cls] = (rows, best, reason)
        cached = sum(1 for r in by_job.values() if r.get("cached"))
        print(f"device class {cls} ({cached}/{len(by_job)} measurements from the cache)\n")
        print(table(constraints, rows, best))
        print(f"\npick: {reason}\n")
    if args.json:
        write_json(as_json(constraints, decided), Path(args.json))
        print(f"wrote {args.json}")
    if args.png:
        for cls, (rows, best, _) in decided.items():
            path = Path(args.png) if len(decided) == 1 else Path(args.png).with_stem(f"{Path(args.png).stem}-{cls}")
            if write_png(rows, best, path, f"edgellm select: {cls}"):
                print(f"wrote {path}")
            else:
                print(f"no chart for {cls}: it needs decode speed and KL (add a speed and a quality constraint)",
                      file=sys.stderr)
    return 0 if any(best is not None for _, best, _ in decided.values()) else 1
