"""The task dataset validates against its own schemas; scoring gives the three separate rates."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from edgellm.eval import tasks

jsonschema = pytest.importorskip("jsonschema")


def validation_errors(items: Iterable[dict[str, Any]]) -> list[str]:
    """Every gold value that does not satisfy its item's schema, by jsonschema."""
    errors = []
    for item in items:
        gold = dict(item["gold"])
        for key, sub in item["schema"].get("properties", {}).items():  # unscored fields: a placeholder
            if key not in gold and sub.get("type") == "string":
                gold[key] = "x"
        for err in jsonschema.Draft202012Validator(item["schema"]).iter_errors(gold):
            errors.append(f"{item['id']}: {err.message}")
    return errors


def test_dataset_shape_and_every_gold_value_satisfies_its_schema() -> None:
    items = tasks.load_dataset()
    assert len(items) >= 100
    assert len({i["id"] for i in items}) == len(items)
    langs = collections.Counter(i["lang"] for i in items)
    assert 0.4 <= langs["zh"] / len(items) <= 0.6
    assert {i["scenario"] for i in items} == {"health", "receipt", "schedule", "tool_call", "classify"}
    assert validation_errors(items) == []
    for item in items:
        jsonschema.Draft202012Validator.check_schema(item["schema"])
        assert set(item["gold"]) <= set(item["schema"]["properties"])


def test_validation_catches_a_bad_gold_value() -> None:
    item = dict(tasks.load_dataset()[0])
    item["gold"] = {**item["gold"], "duration_days": "three"}
    assert any("three" in e for e in validation_errors([item]))


def test_load_dataset_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "input": "x", "schema": {}, "gold": {}}\n{"id": "b"}\n')
    with pytest.raises(Exception, match=r"bad.jsonl:2: item lacks input, schema, gold"):
        tasks.load_dataset(bad)


ITEM = {"id": "r1", "scenario": "receipt", "lang": "en", "input": "...",
        "schema": {"type": "object", "required": ["merchant", "amount", "date"],
                   "properties": {"merchant": {"type": "string"}, "amount": {"type": "number"},
                                  "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}}},
        "gold": {"merchant": "Tesco", "amount": 118.6, "date": "2025-11-26"}}


def test_three_rates_are_separate() -> None:
    right = tasks.score(ITEM, '{"merchant": "TESCO", "amount": "$118.60", "date": "Nov 26, 2025"}', "constrained")
    wrong = tasks.score(ITEM, '{"merchant": "Tesco", "amount": 11.86, "date": "2025-11-26"}', "constrained")
    partial = tasks.score(ITEM, '{"merchant": "Tesco", "amount": 118.6}', "constrained")
    broken = tasks.score(ITEM, '{"merchant": "Tesco", "amount": 118.6, "date": "2025-', "constrained")
    assert (right.valid_json, right.complete, right.correct) == (True, True, True)
    assert (wrong.valid_json, wrong.complete, wrong.correct) == (True, True, False)
    assert "amount=11.86" in wrong.reason
    assert (partial.valid_json, partial.complete, partial.correct) == (True, False, False)
    assert "missing date" in partial.reason
    assert (broken.valid_json, broken.complete, broken.correct) == (False, False, False)
    s = tasks.summarize([right, wrong, partial, broken])
    assert (s["valid_json"], s["fields_complete"], s["values_correct"]) == (75.0, 50.0, 25.0)
    assert s["per_field"] == {"receipt.amount": 50.0, "receipt.date": 50.0, "receipt.merchant": 75.0}
    assert [f["id"] for f in s["failures"]] == ["r1", "r1", "r1"]


def test_unconstrained_replies_go_through_the_tolerant_parser() -> None:
    pytest.importorskip("edgellm.structured.tolerant")
    reply = 'Sure! Here it is:\n```json\n{"merchant": "Tesco", "amount": 118.6, "date": "2025-11-26"}\n```'
    assert tasks.score(ITEM, reply, "unconstrained").correct
    assert not tasks.score(ITEM, reply, "constrained").valid_json  # the strict parser refuses prose


def test_messages_carry_the_schema_in_the_item_language() -> None:
    zh = next(i for i in tasks.load_dataset() if i["lang"] == "zh")
    system, user = tasks.messages(zh)
    assert "JSON Schema" in system["content"] and "提取" in system["content"]
    assert json.dumps(zh["schema"], ensure_ascii=False) in system["content"]
    assert user == {"role": "user", "content": zh["input"]}


def test_items_decoded_together_score_as_their_solo_replies(smollm2_gguf: Path) -> None:
    """evaluate_tasks batches `parallel` items (runtime/batched.py); the report equals one built from each item's
    reply alone on the engine (greedy), in both modes."""
    from edgellm.generation import GenerationParams
    from edgellm.response_format import ResponseFormat
    from edgellm.runtime.engine import Engine

    engine = Engine.load("smollm2-135m", progress=False, threads=1, sequences=3)
    items = tasks.load_dataset()[::20][:5]
    report = tasks.evaluate_tasks(engine, items, max_tokens=48, parallel=3)
    for mode in tasks.MODES:
        outcomes = []
        for item in items:
            fmt = ResponseFormat(type="json_schema", schema=item["schema"]) if mode == "constrained" else None
            engine.reset()
            reply = engine.chat(tasks.messages(item), GenerationParams(max_tokens=48, temperature=0.0,
                                                                        response_format=fmt)).text
            outcomes.append(tasks.score(item, reply, mode))
        want = tasks.summarize(outcomes)
        got = {k: v for k, v in report["modes"][mode].items() if k != "seconds"}
        assert got == want
    engine.close()
