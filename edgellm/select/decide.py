"""From measurements to a decision: pass/fail with margins per constraint, the Pareto front, the pick."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from edgellm.select.candidates import Candidate
from edgellm.select.constraints import METRICS, Constraints, Limit
from edgellm.select.measure import Job


@dataclass
class Check:
    limit: Limit
    value: float | None
    passed: bool
    margin: float | None  # fraction of the bound inside (+) or outside (-) the limit

    def as_dict(self) -> dict[str, Any]:
        return {"constraint": self.limit.name, "bound": self.limit.bound, "value": self.value,
                "passed": self.passed, "margin": self.margin}


@dataclass
class Row:
    candidate: Candidate
    metrics: dict[str, float | None] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    score: float | None = None
    pareto: bool = False

    @property
    def passed(self) -> bool:
        return not self.errors and all(c.passed for c in self.checks)

    def reason(self) -> str:
        """Why it failed: the first error or every broken constraint with its value."""
        if self.errors:
            return self.errors[0]
        broken = [f"{c.limit.name} {c.limit.bound:g}: {'not measured' if c.value is None else f'{c.value:.4g}'}"
                  for c in self.checks if not c.passed]
        return "; ".join(broken)

    def as_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate.as_dict(), "metrics": self.metrics,
                "checks": [c.as_dict() for c in self.checks], "errors": self.errors, "passed": self.passed,
                "score": self.score, "pareto": self.pareto, "reason": None if self.passed else self.reason()}


def rows_for(constraints: Constraints, candidates: list[Candidate], skipped: list[tuple[Candidate, str]],
             results: dict[Job, dict[str, Any]]) -> list[Row]:
    """One row per candidate: its metrics gathered from its speed job and its weights' quality/task jobs."""
    by_weights: dict[tuple[str, tuple[str, str, str, str]], dict[str, Any]] = {}
    by_candidate: dict[Candidate, dict[str, Any]] = {}
    for job, result in results.items():
        if job.kind == "speed":
            by_candidate[job.candidate] = result
        else:
            by_weights[(job.kind, job.candidate.weights)] = result
    rows = [Row(cand, errors=[why]) for cand, why in skipped]
    for cand in candidates:
        row = Row(cand)
        for found in (by_candidate.get(cand), by_weights.get(("quality", cand.weights)),
                      by_weights.get(("task", cand.weights))):
            if found is None:
                continue
            if "error" in found:
                row.errors.append(f"{found['kind']}: {found['error']}")
            row.metrics.update({k: v for k, v in found.items() if k in METRICS})
        rows.append(row)
    for row in rows:
        for limit in constraints.limits:
            value = row.metrics.get(limit.metric)
            row.checks.append(Check(limit, value, limit.passes(value), None if value is None else limit.margin(value)))
    _score(rows, constraints.weights)
    _mark_pareto(rows, sorted({lim.metric for lim in constraints.limits} | set(constraints.weights)))
    return rows


def _score(rows: list[Row], weights: dict[str, float]) -> None:
    """Weighted sum of each metric normalized over the passing rows (1 = best of them, 0 = worst)."""
    passing = [r for r in rows if r.passed]
    for row in passing:
        total = 0.0
        for metric, weight in weights.items():
            values = [v for r in passing if (v := r.metrics.get(metric)) is not None]
            value = row.metrics.get(metric)
            if value is None or not values:
                continue
            lo, hi = min(values), max(values)
            unit = 1.0 if hi == lo else (value - lo) / (hi - lo)
            total += weight * (1.0 - unit if METRICS[metric][0] == "max" else unit)
        row.score = total


def _dominates(a: Row, b: Row, metrics: list[str]) -> bool:
    better = False
    for m in metrics:
        x, y = a.metrics.get(m), b.metrics.get(m)
        if x is None or y is None:
            return False
        if METRICS[m][0] == "max":
            x, y = -x, -y
        if x < y:
            return False
        better = better or x > y
    return better


def _mark_pareto(rows: list[Row], metrics: list[str]) -> None:
    """The front among passing rows (all measured rows when none passes) on every metric the file names."""
    pool = [r for r in rows if r.passed] or [r for r in rows if not r.errors]
    for row in pool:
        row.pareto = not any(_dominates(other, row, metrics) for other in pool if other is not row)


def pick(rows: list[Row], shown: Sequence[str] = ()) -> tuple[Row | None, str]:
    """The best passing row by score, with a one-line reason naming the `shown` metrics (or why there is none)."""
    passing = [r for r in rows if r.passed]
    if not passing:
        measured = [r for r in rows if not r.errors]
        if not measured:
            return None, "no candidate could be measured"
        closest = max(measured, key=lambda r: (-sum(not c.passed for c in r.checks),
                                               min((c.margin for c in r.checks if c.margin is not None), default=-1e9)))
        return None, (f"no candidate meets every constraint; closest (fewest broken, then smallest miss): "
                      f"{closest.candidate.id} ({closest.reason()})")
    best = max(passing, key=lambda r: (r.score or 0.0, r.metrics.get("decode_tok_s") or 0.0))
    figures = ", ".join(f"{METRICS[m][1]} {best.metrics[m]:.4g}" for m in shown or best.metrics
                        if best.metrics.get(m) is not None)
    return best, (f"{best.candidate.id}: meets all {len(best.checks)} constraints and scores best of "
                  f"{len(passing)} passing ({figures})")
