"""`edgellm run --json/--schema/--grammar/--regex`: stdout only the reply, one-line errors, exit 3 when incomplete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgellm.convert.pipeline import convert
from tests.cli.test_cli import assert_one_line_error, edgellm
from tests.support.tiny import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("structured_cli")
    make_tiny(root / "hf", "llama", tied=True)
    return convert(root / "hf", root / "art", quantization="q0f32", progress=False)


def test_regex_reply_is_only_the_constrained_text(tiny: Path) -> None:
    proc = edgellm("run", str(tiny), "--raw", "t1 t2", "--regex", "t7t8", "-n", "5", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["t7", "t8"] and proc.stderr == ""


def test_incomplete_reply_warns_in_one_line_and_exits_3(tiny: Path) -> None:
    proc = edgellm("run", str(tiny), "--raw", "t1 t2", "--regex", "t7t8t9", "-n", "2", "--quiet")
    assert proc.returncode == 3
    assert proc.stdout.split() == ["t7", "t8"]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "incomplete (finish_reason length)" in lines[0]


def test_schema_and_grammar_errors_are_one_line(tiny: Path, tmp_path: Path) -> None:
    unique = tmp_path / "unique.json"
    unique.write_text(json.dumps({"type": "array", "minItems": 2, "uniqueItems": True}))
    proc = edgellm("run", str(tiny), "--raw", "t1", "--schema", str(unique), "--quiet")
    assert_one_line_error(proc, 'schema keyword "uniqueItems" at /uniqueItems cannot be enforced')
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert_one_line_error(edgellm("run", str(tiny), "--raw", "t1", "--schema", str(broken), "--quiet"),
                          "is not JSON")
    grammar = tmp_path / "bad.gbnf"
    grammar.write_text('root ::= "a" |\n')
    assert_one_line_error(edgellm("run", str(tiny), "--raw", "t1", "--grammar", str(grammar), "--quiet"),
                          "invalid EBNF grammar")
    assert_one_line_error(edgellm("run", str(tiny), "--raw", "t1", "--grammar", str(tmp_path / "missing"),
                                  "--quiet"), "cannot read grammar file")


def test_constraint_options_are_exclusive(tiny: Path) -> None:
    proc = edgellm("run", str(tiny), "t1", "--json", "--regex", "a")
    assert proc.returncode == 2 and "not allowed with" in proc.stderr
