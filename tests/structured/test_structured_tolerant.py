"""The tolerant parser over a corpus of realistic dirty model outputs."""

from __future__ import annotations

import pytest

from edgellm.structured.tolerant import lenient_loads, parse_tolerant

PERSON = {"name": "Ada", "age": 36}

# (output as models really write it, expected tier, expected value)
CORPUS = [
    ('{"name": "Ada", "age": 36}', "strict", PERSON),
    ('  \n{"name": "Ada", "age": 36}\n', "strict", PERSON),
    ('[1, 2, 3]', "strict", [1, 2, 3]),
    ('```json\n{"name": "Ada", "age": 36}\n```', "extracted", PERSON),
    ('```\n{"name": "Ada", "age": 36}\n```', "extracted", PERSON),
    ('```JSON\r\n{"name": "Ada", "age": 36}\r\n```', "extracted", PERSON),
    ('Sure! Here is the JSON you asked for:\n\n```json\n{"name": "Ada", "age": 36}\n```\n\nLet me know if you '
     'need anything else.', "extracted", PERSON),
    ('Here is the result: {"name": "Ada", "age": 36}. Hope this helps!', "extracted", PERSON),
    ('The answer is {"name": "Ada", "age": 36}', "extracted", PERSON),
    ('{"name": "Ada", "age": 36}\n\nExplanation: the name is Ada and the age is 36.', "extracted", PERSON),
    ("Step [1]: it's {\"name\": \"Ada\", \"age\": 36} - done", "extracted", PERSON),
    ('JSON:\n{\n  "user": {"name": "Ada", "tags": ["a", "b"]}\n}', "extracted",
     {"user": {"name": "Ada", "tags": ["a", "b"]}}),
    ('{"text": "braces } and ] inside strings"} trailing', "extracted", {"text": "braces } and ] inside strings"}),
    ('{"name": "Ada", "age": 36,}', "lenient", PERSON),
    ('{"tags": ["a", "b",],}', "lenient", {"tags": ["a", "b"]}),
    ("{'name': 'Ada', 'age': 36}", "lenient", PERSON),
    ("{name: 'Ada', age: 36}", "lenient", PERSON),
    ('{"ok": True, "error": None, "done": False}', "lenient", {"ok": True, "error": None, "done": False}),
    ('{\n  // the user\n  "name": "Ada", /* years */ "age": 36\n}', "lenient", PERSON),
    ("```json\n{'name': 'Ada', 'age': 36,}\n```", "lenient", PERSON),
    ("Here you go: {'quote': 'He said \\'hi\\''}", "lenient", {"quote": "He said 'hi'"}),
    ('{"city": "北京", "人口": 21540000,}', "lenient", {"city": "北京", "人口": 21540000}),
    ('{"escaped": "line\\nbreak \\u00e9",}', "lenient", {"escaped": "line\nbreak \u00e9"}),
]

# (output, words the reason must contain)
FAILURES = [
    ('{"name": "Ada", "age": 3', "truncated"),
    ('Here is the JSON:\n```json\n{"name": "Ada", "tags": ["a", "b"', "truncated"),
    ('{"name": "Ad', "truncated"),
    ('[{"name": "Ada"}, {"name": "Bo', "truncated"),
    ("I'm sorry, I cannot produce JSON for that.", "no JSON"),
    ("", "no JSON"),
    ('{"name": Ada Lovelace}', "not JSON"),
]


@pytest.mark.parametrize("text,tier,value", CORPUS)
def test_dirty_outputs_parse_with_the_right_tier(text: str, tier: str, value: object) -> None:
    result = parse_tolerant(text)
    assert (result.ok, result.tier, result.value, result.reason) == (True, tier, value, None)


@pytest.mark.parametrize("text,reason", FAILURES)
def test_unparseable_outputs_are_raw_with_a_reason(text: str, reason: str) -> None:
    result = parse_tolerant(text)
    assert (result.ok, result.tier, result.value) == (False, "raw", None)
    assert reason in result.reason


def test_truncated_json_is_never_completed() -> None:
    # A lenient parser could "repair" this into {"a": [1, 2]}; that would pass off a cut-off answer as valid.
    with pytest.raises(ValueError, match="ends"):
        lenient_loads('{"a": [1, 2')
    assert parse_tolerant('{"a": [1, 2').value is None
