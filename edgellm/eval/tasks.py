"""Structured-extraction evaluation: valid JSON, fields complete, values correct — constrained and not.

An item is `{"id", "lang", "scenario", "input", "schema", "gold"}`. The model gets the schema and
the input through its chat template and answers greedily. Constrained runs use the structured-output
engine (`response_format=json_schema`) and a strict JSON parse; unconstrained runs parse the reply
with the tolerant parser (code fences, leading prose, trailing commas). Three separate rates:
valid JSON (an object came out), fields complete (every required field present and non-empty),
values correct (every gold field equal after normalisation).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from edgellm.errors import EdgeLLMError
from edgellm.eval.normalize import same
from edgellm.runtime.batched import Request, RequestOutcome, generate_many

DEFAULT_DATASET = Path(__file__).parent / "data" / "tasks.jsonl"
MODES = ("constrained", "unconstrained")
_INSTRUCTION = {
    "en": "Extract the information from the user's text. Reply with one JSON object that matches this JSON "
          "Schema, and nothing else:\n{schema}",
    "zh": "从用户的文本中提取信息。只回复一个符合以下 JSON Schema 的 JSON 对象，不要输出其他内容：\n{schema}",
}


def load_dataset(path: str | Path = DEFAULT_DATASET) -> list[dict[str, Any]]:
    """Items from a JSONL file; each must have id, input, schema and gold (a clear error names the line)."""
    items = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EdgeLLMError(f"{path}:{n}: not JSON ({exc.msg})") from None
        missing = [k for k in ("id", "input", "schema", "gold") if k not in item]
        if missing:
            raise EdgeLLMError(f"{path}:{n}: item lacks {', '.join(missing)}")
        items.append(item)
    if not items:
        raise EdgeLLMError(f"{path} has no items")
    return items


def messages(item: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages for one item: schema in the system message, input as the user's."""
    system = _INSTRUCTION.get(item.get("lang", "en"), _INSTRUCTION["en"])
    return [{"role": "system", "content": system.format(schema=json.dumps(item["schema"], ensure_ascii=False))},
            {"role": "user", "content": item["input"]}]


@dataclass
class Outcome:
    """What one reply scored."""

    id: str
    scenario: str
    mode: str
    valid_json: bool
    complete: bool
    correct: bool
    fields: dict[str, bool]
    output: str
    reason: str = ""


def parse_reply(reply: str, mode: str) -> tuple[Any, str]:
    """(value or None, why not): strict JSON for constrained output, the tolerant parser otherwise."""
    if mode == "constrained":
        try:
            return json.loads(reply), ""
        except json.JSONDecodeError as exc:
            return None, f"invalid JSON: {exc.msg}"
    from edgellm.structured.tolerant import parse_tolerant

    res = parse_tolerant(reply)
    return (res.value, "") if res.ok else (None, f"tolerant parser: {res.reason}")


def score(item: dict[str, Any], reply: str, mode: str) -> Outcome:
    """Score one reply against the item's gold values."""
    value, why = parse_reply(reply, mode)
    props = item["schema"].get("properties", {})
    required = item["schema"].get("required", list(props))
    valid = isinstance(value, dict)
    if value is not None and not valid:
        why = f"JSON is a {type(value).__name__}, not an object"
    got = value if valid else {}
    missing = [k for k in required if got.get(k) in (None, "", [])]
    fields = {k: k in got and same(got[k], gold, props.get(k, {})) for k, gold in item["gold"].items()}
    if valid and missing:
        why = f"missing {', '.join(missing)}"
    elif valid and not all(fields.values()):
        wrong = [k for k, ok in fields.items() if not ok]
        why = "wrong " + ", ".join(f"{k}={got.get(k)!r} (gold {item['gold'][k]!r})" for k in wrong)
    return Outcome(item["id"], item.get("scenario", ""), mode, valid, valid and not missing,
                   valid and all(fields.values()), fields, reply, why)


def item_request(engine: Any, item: dict[str, Any], mode: str, max_tokens: int = 160) -> Request:
    """One item's greedy request; constrained mode asks the engine for JSON matching the item's schema."""
    from edgellm.generation import GenerationParams
    from edgellm.response_format import ResponseFormat

    fmt = ResponseFormat(type="json_schema", schema=item["schema"]) if mode == "constrained" else None
    return Request(engine.render(messages(item)), GenerationParams(max_tokens=max_tokens, temperature=0.0,
                                                                   response_format=fmt))


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Rates in percent, per-field accuracy, per-scenario correctness, and the failures."""
    n = len(outcomes)
    pct = lambda k: round(100.0 * k / n, 2) if n else 0.0  # noqa: E731
    per_field: dict[str, list[bool]] = {}
    per_scenario: dict[str, list[bool]] = {}
    for o in outcomes:
        for f, ok in o.fields.items():
            per_field.setdefault(f"{o.scenario}.{f}", []).append(ok)
        per_scenario.setdefault(o.scenario, []).append(o.correct)
    return {
        "items": n,
        "valid_json": pct(sum(o.valid_json for o in outcomes)),
        "fields_complete": pct(sum(o.complete for o in outcomes)),
        "values_correct": pct(sum(o.correct for o in outcomes)),
        "per_field": {k: round(100.0 * sum(v) / len(v), 1) for k, v in sorted(per_field.items())},
        "per_scenario": {k: round(100.0 * sum(v) / len(v), 1) for k, v in sorted(per_scenario.items())},
        "failures": [{"id": o.id, "reason": o.reason, "output": o.output[:300]} for o in outcomes if not o.correct],
    }


def evaluate_tasks(engine: Any, items: Sequence[dict[str, Any]], modes: Sequence[str] = MODES, *,
                   max_tokens: int = 160, progress: Callable[[str], None] | None = None,
                   parallel: int = 1) -> dict[str, Any]:
    """Run every item in every mode, `parallel` items at once through the batched decode step (the replies are
    greedy: the same text as one at a time); a report with `rates` (flat, in percent) for the gate."""
    report: dict[str, Any] = {"kind": "task", "model": engine.name,
                              "scheme": engine.config.quantization.scheme,
                              "size_bytes": engine.artifact.manifest.total_bytes, "modes": {}, "rates": {}}
    for mode in modes:
        if mode not in MODES:
            raise EdgeLLMError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
        t0 = time.perf_counter()
        replies: dict[int, str] = {}

        def reply(index: int, outcome: RequestOutcome, mode: str = mode) -> None:
            if isinstance(outcome, EdgeLLMError):
                raise outcome  # as a lone request's would: the evaluation stops
            replies[index] = outcome.text
            if progress:
                progress(f"{mode} {len(replies)}/{len(items)}")

        generate_many(engine, [item_request(engine, item, mode, max_tokens) for item in items], reply,
                      parallel=parallel)
        summary = summarize([score(item, replies[i], mode) for i, item in enumerate(items)])
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        report["modes"][mode] = summary
        for rate in ("valid_json", "fields_complete", "values_correct"):
            report["rates"][f"{mode}.{rate}"] = summary[rate]
    return report
