"""The official JSON-Schema-Test-Suite through the schema → grammar path: `python -m edgellm.bench.schema_suite`.

Every test schema of a draft is compiled as a request would be (`ResponseFormat("json_schema", schema)`, strict
unless `--no-strict`), and every test instance is fed to an xgrammar matcher: accepted means the decoder may emit
it. The instance is written as the grammar writes JSON (compact: `", "` and `": "`), in each spelling of the same
value (non-ASCII text as itself and as `\\u` escapes, an integral number with and without `.0`, an object's keys
in any order): accepted when one of them is. Per keyword file:

- refused: the schema was refused by name (a SchemaError naming the keyword and its pointer);
- silent gaps: invalid instances the grammar accepts — a broken promise, must be 0;
- valid accepted: valid instances the grammar accepts (the rest are narrowings, or what strict mode closes);
- unreported: valid instances rejected while the compiled format lists no narrowing (strict mode's closed
  objects land here, as they are what strict asks for).

Groups whose schema needs a document other than itself (the suite's remotes, a `$ref` the reference validator
cannot resolve without fetching) are skipped and counted. The suite ships in the `jsonschema` package's source
distribution (`json/tests/...`); `--fetch` gets it with `pip download --no-binary jsonschema --no-deps jsonschema`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import referencing.exceptions
from jsonschema.validators import validator_for

from edgellm.errors import EdgeLLMError, SchemaError
from edgellm.structured.grammar import CompiledFormat, GrammarCache, compile_format
from edgellm.structured.xgrammar_core import core
from edgellm.response_format import ResponseFormat

DRAFTS = {"2020-12": ("draft2020-12", "https://json-schema.org/draft/2020-12/schema"),
          "2019-09": ("draft2019-09", "https://json-schema.org/draft/2019-09/schema"),
          "7": ("draft7", "http://json-schema.org/draft-07/schema#")}
# A vocabulary of single characters: acceptance of a string does not depend on the tokenizer, compiling is fast.
_VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "\t", "é", "</s>"]
_MAX_SPELLINGS = 64


@dataclass
class Case:
    """One test schema's outcome: refused (with the SchemaError), or compiled with its instances' verdicts."""

    file: str
    description: str
    refused: str = ""
    keyword: str = ""
    crash: str = ""
    narrowed: tuple[str, ...] = ()
    gaps: list[str] = field(default_factory=list)  # descriptions of invalid instances the grammar accepts
    valid: int = 0
    valid_accepted: int = 0
    invalid: int = 0
    invalid_rejected: int = 0
    rejected_valid: list[str] = field(default_factory=list)


@dataclass
class FileReport:
    """Counts for one keyword file of the suite."""

    file: str
    schemas: int = 0
    refused: int = 0
    skipped: int = 0
    valid: int = 0
    valid_accepted: int = 0
    invalid: int = 0
    gaps: int = 0
    unreported: int = 0
    crashes: int = 0


def suite_cache() -> GrammarCache:
    """A grammar compiler over a one-character vocabulary (no model needed)."""
    info = core().tokenizer_info(_VOCAB, "RAW", len(_VOCAB), [len(_VOCAB) - 1], False)
    return GrammarCache(info, threads=1, capacity=1)


def fetch_suite(into: Path) -> Path:
    """Download the `jsonschema` sdist into `into` with pip and unpack its suite; the suite's root folder."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", "jsonschema", "--no-deps",
                           "jsonschema", "-d", str(into), "-q"], capture_output=True, text=True, timeout=300)
    archives = sorted(into.glob("jsonschema-*.tar.gz"))
    if done.returncode != 0 or not archives:
        lines = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        reason = (lines or ["no archive"])[-1].strip()
        raise EdgeLLMError(f"pip download of the jsonschema sdist failed: {reason}")
    return unpack_suite(archives[-1], into)


def unpack_suite(archive: Path, into: Path) -> Path:
    """The suite's files (`json/tests/draft*/*.json` and its LICENSE) of a jsonschema sdist, unpacked in `into`."""
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and "/json/" in m.name and (
            m.name.endswith("/json/LICENSE") or ("/json/tests/draft" in m.name and m.name.endswith(".json")))]
        if not members:
            raise EdgeLLMError(f"{archive.name} holds no JSON-Schema-Test-Suite (json/tests/)")
        for m in members:
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                raise EdgeLLMError(f"{archive.name}: unsafe member path {m.name!r}")
        tar.extractall(into, members=members, filter="data")
    return into / members[0].name.split("/json/")[0] / "json"


def _needs_remote(schema: Any, dialect: str, tests: list[dict[str, Any]]) -> bool:
    """Does validating this group fetch another document (the reference validator fails to resolve it)?"""
    root = schema if not isinstance(schema, dict) or "$schema" in schema else {**schema, "$schema": dialect}
    validator = validator_for(root)(root)
    for test in tests:
        try:
            validator.is_valid(test["data"])
        except (referencing.exceptions.Unresolvable, jsonschema.exceptions.RefResolutionError):
            return True
    return False


def _spellings(value: Any, ascii_only: bool) -> list[str]:
    """Ways to write `value` in the grammar's compact JSON that JSON Schema counts as the same value: an integral
    number with or without `.0`, an object's keys in any order (up to _MAX_SPELLINGS in all)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return [json.dumps(value, ensure_ascii=ascii_only)]
    if isinstance(value, int):
        return [str(value), f"{value}.0"]
    if isinstance(value, float):
        return [json.dumps(value, allow_nan=False)] + ([str(int(value))] if value.is_integer() else [])
    if isinstance(value, list):
        return [f"[{inner}]" for inner in _joined([_spellings(v, ascii_only) for v in value])]
    orders = list(itertools.islice(itertools.permutations(value), _MAX_SPELLINGS)) if value else [()]
    out: list[str] = []
    for order in orders:
        members = [[f"{json.dumps(k, ensure_ascii=ascii_only)}: {v}" for v in _spellings(value[k], ascii_only)]
                   for k in order]
        out += [f"{{{inner}}}" for inner in _joined(members)]
        if len(out) >= _MAX_SPELLINGS:
            break
    return out[:_MAX_SPELLINGS]


def _joined(parts: list[list[str]]) -> list[str]:
    """", "-joined combinations of one spelling per part (the first _MAX_SPELLINGS)."""
    return [", ".join(c) for c in itertools.islice(itertools.product(*parts), _MAX_SPELLINGS)]


def _accepts(compiled: CompiledFormat, value: Any) -> bool:
    """May the decoder emit `value` (in one of its spellings)?"""
    for text in dict.fromkeys([*_spellings(value, False), *_spellings(value, True)]):
        matcher = core().matcher(compiled.grammar)
        if matcher.accept_string(text) and matcher.is_completed():
            return True
    return False


def run_group(cache: GrammarCache, file: str, group: dict[str, Any], dialect: str, strict: bool) -> Case:
    """Compile one test group's schema and feed it every instance."""
    schema = group["schema"]
    case = Case(file, group["description"])
    if isinstance(schema, dict) and "$schema" not in schema:
        schema = {**schema, "$schema": dialect}
    try:
        compiled = compile_format(cache, ResponseFormat("json_schema", schema=schema, strict=strict))
    except SchemaError as e:
        case.refused, case.keyword = str(e), e.keyword or "(schema)"
        return case
    except Exception as e:  # noqa: BLE001 - a crash of the rewrite is a finding of its own, listed by the tool
        case.crash = f"{type(e).__name__}: {e}"
        return case
    assert compiled is not None
    case.narrowed = compiled.narrowed
    for test in group["tests"]:
        accepted = _accepts(compiled, test["data"])
        if test["valid"]:
            case.valid += 1
            case.valid_accepted += accepted
            if not accepted:
                case.rejected_valid.append(test["description"])
        else:
            case.invalid += 1
            case.invalid_rejected += not accepted
            if accepted:
                case.gaps.append(test["description"])
    return case


def run_draft(root: Path, draft: str, *, strict: bool = True,
              only: str | None = None) -> tuple[list[FileReport], list[Case]]:
    """Every top-level test file of `draft` (optional/ left out) under the suite folder `root`."""
    folder, dialect = DRAFTS[draft]
    cache = suite_cache()
    reports, cases = [], []
    for path in sorted((root / "tests" / folder).glob("*.json")):
        if only is not None and path.stem != only:
            continue
        report = FileReport(path.stem)
        for group in json.loads(path.read_text(encoding="utf-8")):
            report.schemas += 1
            if not isinstance(group["schema"], (dict, bool)) or _needs_remote(group["schema"], dialect,
                                                                              group["tests"]):
                report.skipped += 1
                continue
            if isinstance(group["schema"], bool):  # a boolean schema is not an object: not a request shape
                report.skipped += 1
                continue
            case = run_group(cache, path.stem, group, dialect, strict)
            cache.clear()
            cases.append(case)
            if case.refused or case.crash:
                report.refused += bool(case.refused)
                report.crashes += bool(case.crash)
                continue
            report.valid += case.valid
            report.valid_accepted += case.valid_accepted
            report.invalid += case.invalid
            report.gaps += len(case.gaps)
            report.unreported += 0 if case.narrowed else len(case.rejected_valid)
        reports.append(report)
    return reports, cases


def totals(reports: list[FileReport]) -> FileReport:
    out = FileReport("total")
    for r in reports:
        for key in ("schemas", "refused", "skipped", "valid", "valid_accepted", "invalid", "gaps", "unreported", "crashes"):
            setattr(out, key, getattr(out, key) + getattr(r, key))
    return out


def markdown_table(reports: list[FileReport]) -> str:
    """The per-file table docs/structured-output.md shows."""
    lines = ["| file | schemas | skipped (remote, boolean) | refused | compiled | silent gaps | valid accepted |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in [*reports, totals(reports)]:
        compiled = r.schemas - r.skipped - r.refused
        name = f"**{r.file}**" if r.file == "total" else r.file
        lines.append(f"| {name} | {r.schemas} | {r.skipped} | {r.refused} | {compiled} | {r.gaps} | "
                     f"{r.valid_accepted}/{r.valid} |")
    return "\n".join(lines)


def _summary(draft: str, reports: list[FileReport], cases: list[Case]) -> str:
    t = totals(reports)
    run = t.schemas - t.skipped
    share = f"{100 * t.valid_accepted / t.valid:.1f}%" if t.valid else "-"
    return (f"draft {draft}: {t.schemas} schemas, {t.skipped} skipped, {run} run: {t.refused} refused, "
            f"{run - t.refused} compiled; invalid instances accepted (silent gaps): {t.gaps}/{t.invalid}; "
            f"valid instances accepted: {t.valid_accepted}/{t.valid} ({share}); "
            f"valid rejected with no narrowing reported: {t.unreported}; crashes: {t.crashes}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgellm.bench.schema_suite", description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--suite", type=Path, help="the suite folder (holding tests/draft*) or a jsonschema sdist")
    where.add_argument("--fetch", action="store_true", help="pip download the jsonschema sdist and use its suite")
    p.add_argument("--draft", action="append", choices=sorted(DRAFTS), help="drafts to run (default: all three)")
    p.add_argument("--file", help="only this keyword file (e.g. dependentRequired)")
    p.add_argument("--no-strict", action="store_true", help="plain JSON Schema objects (strict closes them)")
    p.add_argument("--details", action="store_true", help="list refusals, gaps and rejected valid instances")
    p.add_argument("--markdown", action="store_true", help="print the per-file table as markdown")
    p.add_argument("--json", type=Path, help="write every case and file count here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.fetch:
                root = fetch_suite(Path(tmp))
            elif args.suite.is_file():
                root = unpack_suite(args.suite, Path(tmp))
            else:
                root = args.suite
        except (EdgeLLMError, OSError, tarfile.TarError, subprocess.TimeoutExpired) as e:
            print(f"edgellm: error: {e}", file=sys.stderr)
            return 2
        if not (root / "tests").is_dir():
            print(f"edgellm: error: {root} holds no tests/ folder of the JSON-Schema-Test-Suite", file=sys.stderr)
            return 2
        out: dict[str, Any] = {}
        gaps = 0
        for draft in args.draft or list(DRAFTS):
            reports, cases = run_draft(root, draft, strict=not args.no_strict, only=args.file)
            gaps += totals(reports).gaps + totals(reports).crashes
            print(_summary(draft, reports, cases))
            if args.markdown:
                print(markdown_table(reports))
            if args.details:
                for c in cases:
                    if c.refused:
                        print(f"  refused  {c.file}: {c.description}: {c.refused}")
                    if c.crash:
                        print(f"  CRASH    {c.file}: {c.description}: {c.crash}")
                    for g in c.gaps:
                        print(f"  GAP      {c.file}: {c.description} / {g}")
                    for v in c.rejected_valid:
                        print(f"  narrowed {c.file}: {c.description} / {v}"
                              + (f" [{', '.join(c.narrowed)}]" if c.narrowed else " [nothing reported]"))
            out[draft] = {"files": [asdict(r) for r in reports], "cases": [asdict(c) for c in cases]}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, ensure_ascii=False))
    return 1 if gaps else 0  # (a silent gap or a crash)


if __name__ == "__main__":
    sys.exit(main())
