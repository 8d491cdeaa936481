"""The release gate: compare the tracked rates of two eval reports; fail on a drop over the threshold."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError


def tracked_rates(report: dict[str, Any]) -> dict[str, float]:
    """The report's `rates` (percent; higher is better), flattened over a list of reports if given one."""
    if isinstance(report, list):
        out: dict[str, float] = {}
        for r in report:
            out.update({f"{r.get('model', '?')}/{k}": v for k, v in tracked_rates(r).items()})
        return out
    rates = report.get("rates")
    if not isinstance(rates, dict) or not rates:
        raise EdgeLLMError("the report has no 'rates' to gate on (write it with `edgellm eval ... --json`)")
    bad = [k for k, v in rates.items() if not isinstance(v, (int, float)) or isinstance(v, bool)]
    if bad:
        raise EdgeLLMError(f"rate {bad[0]!r} is not a number")
    return {k: float(v) for k, v in rates.items()}


def load_report(path: str | Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgeLLMError(f"no such report: {path}") from None
    except json.JSONDecodeError as exc:
        raise EdgeLLMError(f"{path} is not JSON ({exc.msg} at line {exc.lineno})") from None


@dataclass(frozen=True)
class GateRow:
    name: str
    baseline: float | None
    candidate: float | None
    failed: bool

    @property
    def change(self) -> float | None:
        return None if self.baseline is None or self.candidate is None else self.candidate - self.baseline


def compare(baseline: dict[str, Any], candidate: dict[str, Any], max_drop: float) -> list[GateRow]:
    """One row per rate in either report; a row fails if it dropped by more than `max_drop` points
    or is missing from the candidate."""
    old, new = tracked_rates(baseline), tracked_rates(candidate)
    rows = []
    for name in sorted(old.keys() | new.keys()):
        b, c = old.get(name), new.get(name)
        failed = b is not None and (c is None or b - c > max_drop + 1e-9)
        rows.append(GateRow(name, b, c, failed))
    return rows


def format_rows(rows: list[GateRow], max_drop: float) -> str:
    """A readable diff: every rate with its change, failures marked."""
    width = max(len(r.name) for r in rows)
    fmt = lambda v: "   —  " if v is None else f"{v:6.2f}"  # noqa: E731
    lines = [f"{'rate':<{width}}  baseline  candidate   change"]
    for r in rows:
        change = "   new" if r.baseline is None else " missing" if r.candidate is None else f"{r.change:+7.2f}"
        mark = f"  FAIL (drop > {max_drop:g} points)" if r.failed else ""
        lines.append(f"{r.name:<{width}}  {fmt(r.baseline)}    {fmt(r.candidate)}  {change}{mark}")
    failed = sum(r.failed for r in rows)
    lines.append(f"gate: {'FAILED' if failed else 'passed'} — {failed} of {len(rows)} rates dropped by more "
                 f"than {max_drop:g} points" if failed else
                 f"gate: passed — no rate dropped by more than {max_drop:g} points ({len(rows)} checked)")
    return "\n".join(lines)
