"""The official JSON-Schema-Test-Suite (from the `jsonschema` sdist, fetched with pip at test time) through the schema →
grammar path: no invalid instance the grammar accepts, no crash, and every valid instance it rejects reported as a
narrowing (plain JSON Schema objects; strict mode closes objects by request), on each draft edgellm supports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from edgellm.errors import EdgeLLMError
from edgellm.bench import schema_suite as suite

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def suite_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("suite")
    try:
        return suite.fetch_suite(where)
    except (EdgeLLMError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"no package registry reachable for the jsonschema sdist (pip download): {e}")


@pytest.mark.parametrize("draft", sorted(suite.DRAFTS))
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "plain"])
def test_no_silent_gap_and_every_narrowing_reported(suite_root: Path, draft: str, strict: bool) -> None:
    reports, cases = suite.run_draft(suite_root, draft, strict=strict)
    total = suite.totals(reports)
    assert total.schemas > 200 and total.valid > 300  # the suite was found and run
    gaps = [f"{c.file}: {c.description} / {g}" for c in cases for g in c.gaps]
    assert gaps == []
    assert [f"{c.file}: {c.description}: {c.crash}" for c in cases if c.crash] == []
    if not strict:  # (strict mode's closed objects and arrays are what it asks for, not a narrowing)
        silent = [f"{c.file}: {c.description} / {v}" for c in cases if not c.narrowed for v in c.rejected_valid]
        assert silent == []


def test_refusals_stay_within_what_is_measured(suite_root: Path) -> None:
    """The counts docs/structured-output.md shows for draft 2020-12 (strict): fewer refusals only."""
    reports, _ = suite.run_draft(suite_root, "2020-12")
    total = suite.totals(reports)
    assert total.refused <= 23, suite.markdown_table(reports)
    assert total.valid_accepted >= 592, suite.markdown_table(reports)


def test_the_tool_runs_offline_on_an_unpacked_suite(suite_root: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "edgellm.bench.schema_suite", "--suite", str(suite_root), "--draft",
                           "7", "--file", "required", "--details"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("draft 7: ") and "silent gaps): 0/" in proc.stdout


def test_the_tool_says_why_without_a_suite(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "edgellm.bench.schema_suite", "--suite", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("edgellm: error: ") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
