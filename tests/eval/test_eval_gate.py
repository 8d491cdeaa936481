"""The release gate through the CLI: a 6-point drop fails (exit 1), a 4-point drop passes (exit 0)."""

from __future__ import annotations

import json
from pathlib import Path

from edgellm.cli import main


def _report(path: Path, rates: dict[str, float]) -> str:
    path.write_text(json.dumps({"kind": "task", "model": "m", "rates": rates}))
    return str(path)


def _gate(tmp_path: Path, old: dict[str, float], new: dict[str, float], *extra: str) -> int:
    return main(["eval", "gate", "--baseline", _report(tmp_path / "old.json", old),
                 "--candidate", _report(tmp_path / "new.json", new), *extra])


def test_six_point_drop_fails(tmp_path: Path, capsys) -> None:
    old = {"constrained.values_correct": 80.0, "constrained.valid_json": 100.0}
    assert _gate(tmp_path, old, {"constrained.values_correct": 74.0, "constrained.valid_json": 100.0},
                 "--max-drop", "5") == 1
    out = capsys.readouterr().out
    assert "constrained.values_correct" in out and "-6.00" in out and "FAIL" in out and "gate: FAILED" in out


def test_four_point_drop_passes(tmp_path: Path, capsys) -> None:
    assert _gate(tmp_path, {"unconstrained.valid_json": 90.0}, {"unconstrained.valid_json": 86.0},
                 "--max-drop", "5") == 0
    out = capsys.readouterr().out
    assert "-4.00" in out and "gate: passed" in out and "FAIL" not in out


def test_exactly_the_threshold_passes_and_default_is_five(tmp_path: Path) -> None:
    assert _gate(tmp_path, {"a": 50.0}, {"a": 45.0}) == 0
    assert _gate(tmp_path, {"a": 50.0}, {"a": 44.9}) == 1


def test_missing_rate_fails_and_new_rate_is_listed(tmp_path: Path, capsys) -> None:
    assert _gate(tmp_path, {"a": 50.0, "b": 10.0}, {"a": 50.0, "c": 1.0}) == 1
    out = capsys.readouterr().out
    assert "missing" in out and "new" in out


def test_bad_reports_are_one_line_errors(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["eval", "gate", "--baseline", str(bad), "--candidate", str(bad)]) == 1
    assert "is not JSON" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert main(["eval", "gate", "--baseline", str(empty), "--candidate", str(empty)]) == 1
    assert "no 'rates'" in capsys.readouterr().err
