r"""Unicode property escapes in patterns (`\p{Cc}`), which ECMA-262 reads and Python's `re` and xgrammar do not.

A property whose code points are a small, fixed set (all in the Basic Multilingual Plane, so xgrammar reads every
bound) is spelled out as a character class, exactly: `\p{Cc}` is `[\x00-\x1f\x7f-\x9f]`, inside a class its ranges;
`\P{Cc}` outside a class is `[^\x00-\x1f\x7f-\x9f]`. Any other property (`\p{L}`: hundreds of ranges that change
with the Unicode version) and `\P{...}` inside a class are refused, naming the escape.
"""

from __future__ import annotations

import re
from typing import Any

from edgellm.errors import SchemaError, pointer_token

_CC = ((0x00, 0x1F), (0x7F, 0x9F))
# property name (as ECMA-262 spells it) -> code point ranges; Cc and the ASCII sets never change between versions
PROPERTIES: dict[str, tuple[tuple[int, int], ...]] = {
    "Cc": _CC, "Control": _CC, "gc=Cc": _CC, "gc=Control": _CC, "General_Category=Cc": _CC,
    "General_Category=Control": _CC,
    "ASCII": ((0x00, 0x7F),),
    "ASCII_Hex_Digit": ((0x30, 0x39), (0x41, 0x46), (0x61, 0x66)), "AHex": ((0x30, 0x39), (0x41, 0x46), (0x61, 0x66)),
}
_ESCAPE = re.compile(r"\\([pP])\{([^}]*)\}")
_DATA = frozenset({"enum", "const", "default", "examples"})


def _class_body(ranges: tuple[tuple[int, int], ...]) -> str:
    def one(c: int) -> str:
        return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"

    return "".join(one(a) if a == b else f"{one(a)}-{one(b)}" for a, b in ranges)


def translate(pattern: str) -> str:
    """`pattern` with its Unicode property escapes spelled out; ValueError naming the first one that cannot be."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            m = _ESCAPE.match(pattern, i)
            if m is None:
                out.append(pattern[i:i + 2])
                i += 2
                continue
            ranges = PROPERTIES.get(m.group(2))
            if ranges is None:
                raise ValueError(f"Unicode property escape {m.group(0)} has no exact character class here "
                                 f"(spelled out: {', '.join(sorted(PROPERTIES))})")
            body = _class_body(ranges)
            if m.group(1) == "p":
                out.append(body if in_class else f"[{body}]")
            elif in_class:
                raise ValueError(f"Unicode property escape {m.group(0)} inside a character class is not spelled out")
            else:
                out.append(f"[^{body}]")
            i = m.end()
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(pattern[i:i + 2] if pattern.startswith("[^", i) else c)
            i += 2 if pattern.startswith("[^", i) else 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def translate_schema(schema: Any, pointer: str = "") -> Any:
    """`schema` with every `pattern` and `patternProperties` name translated (the input is not modified); a copy is
    made only where something changes. SchemaError names the pattern that cannot be translated."""
    if isinstance(schema, list):
        items = [translate_schema(v, f"{pointer}/{i}") for i, v in enumerate(schema)]
        return items if any(a is not b for a, b in zip(items, schema)) else schema
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        here = f"{pointer}/{pointer_token(key)}"
        if key in _DATA:
            out[key] = value
        elif key == "pattern" and isinstance(value, str) and "\\p" in value.replace("\\P", "\\p"):
            out[key] = _translated(value, "pattern", here)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {_translated(name, key, f"{here}/{pointer_token(name)}") if "\\p" in name.replace("\\P", "\\p")
                        else name: translate_schema(sub, f"{here}/{pointer_token(name)}") for name, sub in value.items()}
        else:
            out[key] = translate_schema(value, here)
    return out if any(out[k] is not schema[k] for k in schema) else schema


def _translated(pattern: str, keyword: str, pointer: str) -> str:
    try:
        return translate(pattern)
    except ValueError as e:
        raise SchemaError(f'schema keyword "{keyword}" at {pointer} cannot be enforced: {e}', keyword=keyword,
                          pointer=pointer) from None
