"""Run the real-world schema corpus: `python -m edgellm.bench.schema_corpus [MODEL] [--max-tokens 384]`.

Every schema in `data/schemas/manifest.json` (SchemaStore and Kubernetes schemas, licences noted there) is asked
for with one generic prompt at temperature 0, and each outcome is classified:

- ``ok``: finished (`complete`) and the value validates with `jsonschema` (formats checked);
- ``length``: cut off by max_tokens (never valid JSON, reported as such);
- ``refused``: the schema has a keyword the grammar cannot enforce (the keyword and its pointer are printed);
- ``invalid``: finished but does not validate — a promise broken, must stay 0;
- ``crash``: any other exception — must stay 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError, SchemaError
from edgellm.generation import GenerationParams
from edgellm.response_format import ResponseFormat
from edgellm.structured.validate import schema_errors

CORPUS = Path(__file__).parent / "data" / "schemas"
PROMPT = "Write a short, realistic example of a {name} document as JSON. Reply with the JSON only."


@dataclass
class Outcome:
    """One schema's result: status is ok | length | refused | invalid | crash."""

    file: str
    status: str
    detail: str = ""
    tokens: int = 0
    seconds: float = 0.0
    guard_interventions: int = 0
    text: str = ""


def load_corpus(folder: Path = CORPUS) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(manifest entry, schema) for every schema of the corpus, in manifest order."""
    manifest = json.loads((folder / "manifest.json").read_text())
    return [(entry, json.loads((folder / entry["file"]).read_text(encoding="utf-8"))) for entry in manifest]


def _display_name(entry: dict[str, Any], schema: dict[str, Any]) -> str:
    title = schema.get("title")
    if isinstance(title, str) and 0 < len(title) <= 60:
        return title
    return entry["file"].removesuffix(".json").removeprefix("k8s-").replace("-", " ")


def run_one(engine: Any, entry: dict[str, Any], schema: dict[str, Any], params: GenerationParams,
            strict: bool = True) -> Outcome:
    """Generate for one schema and classify the outcome (never raises)."""
    messages = [{"role": "user", "content": PROMPT.format(name=_display_name(entry, schema))}]
    rf = ResponseFormat("json_schema", schema=schema, strict=strict)
    t0 = time.perf_counter()
    try:
        result = engine.chat(messages, replace(params, response_format=rf))
    except SchemaError as e:
        where = f"{e.keyword} at {e.pointer}" if getattr(e, "keyword", None) else "no keyword named"
        return Outcome(entry["file"], "refused", f"{where}: {e}", seconds=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - the corpus run reports every failure instead of stopping
        return Outcome(entry["file"], "crash", f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    out = Outcome(entry["file"], "ok", tokens=result.stats.completion_tokens, seconds=time.perf_counter() - t0,
                  guard_interventions=getattr(result.stats, "guard_interventions", 0), text=result.text)
    if not result.complete:
        out.status, out.detail = "length", f"finish_reason {result.finish_reason}"
        return out
    try:
        errors = schema_errors(json.loads(result.text), schema)
    except Exception as e:  # noqa: BLE001 - e.g. a remote $ref jsonschema cannot resolve
        out.status, out.detail = "crash", f"validation failed to run: {type(e).__name__}: {e}"
        return out
    if errors:
        out.status, out.detail = "invalid", errors[0]
    return out


def summarize(outcomes: list[Outcome]) -> dict[str, int]:
    counts = {k: 0 for k in ("ok", "length", "refused", "invalid", "crash")}
    for o in outcomes:
        counts[o.status] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgellm.bench.schema_corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m", help="catalog name or artifact folder")
    ap.add_argument("--quantization", help="scheme (default: the model's default)")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--sample", type=int, help="run only N schemas, drawn with --seed (to cap the run time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", help="run only these files of the corpus")
    ap.add_argument("--no-guard", action="store_true", help="turn the loop guard off (for a before/after table)")
    ap.add_argument("--json", metavar="FILE", help="also write every outcome (with the output text) to FILE")
    args = ap.parse_args(argv)
    from edgellm.runtime.engine import Engine

    corpus = load_corpus()
    if args.only:
        corpus = [c for c in corpus if c[0]["file"] in set(args.only)]
    if args.sample:
        corpus = random.Random(args.seed).sample(corpus, min(args.sample, len(corpus)))
    try:
        engine = Engine.load(args.model, quantization=args.quantization, progress=False, threads=args.threads)
    except EdgeLLMError as e:
        print(f"edgellm: error: {e}", file=sys.stderr)
        return 1
    params = GenerationParams(max_tokens=args.max_tokens, temperature=0.0)
    if args.no_guard and "loop_guard" in GenerationParams.__dataclass_fields__:
        params = replace(params, loop_guard=None)
    print(f"model {engine.name}  max_tokens {args.max_tokens}  {len(corpus)} schemas  temperature 0")
    outcomes = []
    for entry, schema in corpus:
        o = run_one(engine, entry, schema, params)
        outcomes.append(o)
        guard = f"  guard {o.guard_interventions}" if o.guard_interventions else ""
        print(f"{o.file:48s} {o.status:8s} {o.tokens:4d} tok {o.seconds:6.1f}s{guard}  {o.detail[:110]}", flush=True)
    counts = summarize(outcomes)
    n = len(outcomes)
    print("total: " + "  ".join(f"{k} {v}" for k, v in counts.items())
          + f"  ({100 * counts['ok'] / max(n, 1):.0f}% finished and valid)")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(o) for o in outcomes], indent=1, ensure_ascii=False) + "\n")
    return 0 if counts["invalid"] == 0 and counts["crash"] == 0 else 2


if __name__ == "__main__":
    sys.exit(main())
