"""`edgellm run` options for structured output: --json, --schema FILE, --grammar FILE, --regex PATTERN."""

from __future__ import annotations

import argparse
import importlib
import json
import threading
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError, SchemaError
from edgellm.structured.pattern_bound import check_grammar_format, check_regex_format
from edgellm.response_format import ResponseFormat

INCOMPLETE_EXIT = 3  # the constrained output did not complete (e.g. cut off by --max-tokens)


def add_structured_args(p: argparse.ArgumentParser) -> None:
    """Add the mutually exclusive constraint options to a parser."""
    group = p.add_argument_group(
        "structured output",
        f"Constrain the reply. Whitespace is compact by default (one line). If the reply is cut off before the "
        f"grammar completes (e.g. by --max-tokens), a one-line warning goes to stderr and the exit status is "
        f"{INCOMPLETE_EXIT}.")
    one = group.add_mutually_exclusive_group()
    one.add_argument("--json", action="store_true", help="reply with one JSON object")
    one.add_argument("--schema", metavar="FILE", help="reply with JSON valid against this JSON Schema file (or an "
                     'OpenAI {"name", "schema", "strict"} object)')
    one.add_argument("--grammar", metavar="FILE", help="reply in this EBNF grammar (GBNF style, with a root rule)")
    one.add_argument("--regex", metavar="PATTERN", help="reply matching this regular expression")
    group.add_argument("--best-effort", action="store_true",
                       help="with --schema: generate even if some keywords cannot be enforced (listed on stderr)")
    group.add_argument("--no-loop-guard", action="store_true",
                       help="with --json/--schema: do not steer out of degenerate repetitions inside a value (the "
                       "guard is on by default; its interventions are reported on stderr)")
    group.add_argument("--budget-finish", action="store_true",
                       help="with --json/--schema: near --max-tokens, steer to a short valid close (reported as "
                       "budget-closed, exit status 3)")


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise EdgeLLMError(f"cannot read {what} file {path}: {e.strerror or e}") from None


def guard_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """GenerationParams keyword arguments for --no-loop-guard and --budget-finish."""
    out: dict[str, Any] = {"budget_finish": bool(getattr(args, "budget_finish", False))}
    if getattr(args, "no_loop_guard", False):
        out["loop_guard"] = None
    return out


def response_format_from_args(args: argparse.Namespace) -> ResponseFormat | None:
    """The ResponseFormat the options ask for (None without one); with one, what the request will need first and
    no tokenizer decides (the grammar modules, a schema's checks, xgrammar's bindings) starts loading in the
    background, meanwhile the model loads."""
    fmt = _response_format(args)
    if fmt is not None:
        threading.Thread(target=_load_grammar, args=(fmt.type == "json_schema",), daemon=True,
                         name="edgellm-grammar-load").start()
    return fmt


def _load_grammar(schema: bool) -> None:
    try:
        importlib.import_module("edgellm.structured.processor")
        importlib.import_module("edgellm.structured.grammar")
        if schema:
            importlib.import_module("edgellm.structured.schema_support")
        importlib.import_module("edgellm.structured.xgrammar_core").core()
    except Exception:  # noqa: BLE001 - the request's own import reports the problem, in one line
        pass


def _response_format(args: argparse.Namespace) -> ResponseFormat | None:
    if getattr(args, "json", False):
        return ResponseFormat("json_object")
    if getattr(args, "schema", None):
        try:
            schema = json.loads(_read(args.schema, "schema"))
        except ValueError as e:
            raise SchemaError(f"schema file {args.schema} is not JSON: {e}") from None
        strict = True
        if isinstance(schema, dict) and isinstance(schema.get("schema"), dict) and "type" not in schema:
            strict = schema.get("strict", True) is not False
            schema = schema["schema"]  # the OpenAI json_schema wrapper
        return ResponseFormat("json_schema", schema=schema, strict=strict, best_effort=args.best_effort)
    if getattr(args, "grammar", None):
        grammar = _read(args.grammar, "grammar")
        check_grammar_format(grammar)
        return ResponseFormat("grammar", grammar=grammar)
    if getattr(args, "regex", None):
        check_regex_format(args.regex)  # a malformed or too costly pattern fails before the model loads
        return ResponseFormat("regex", regex=args.regex)
    return None
