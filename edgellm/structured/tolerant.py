"""Tolerant JSON parsing for unconstrained model output: strict → extracted → lenient → raw (seed 000 §3.4).

Never repairs truncated JSON: an object that is cut off is reported as such (tier "raw"), never completed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\r?\n(.*?)(?:```|\Z)", re.DOTALL)
_CLOSE = {"{": "}", "[": "]"}


@dataclass(frozen=True)
class TolerantResult:
    """value: the parsed JSON (None unless ok); tier: "strict" | "extracted" | "lenient" | "raw"."""

    value: Any | None
    ok: bool
    tier: str
    reason: str | None = None


class _Truncated(ValueError):
    """The text ends inside a JSON value."""


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at `start`; raises _Truncated if the text ends first."""
    stack = [_CLOSE[text[start]]]
    quote = None
    i = start + 1
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in _CLOSE:
            stack.append(_CLOSE[ch])
        elif ch in "}]":
            if ch != stack[-1]:
                raise ValueError(f"mismatched {ch!r} at offset {i}")
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    raise _Truncated(f"the text ends inside {'a string in ' if quote else ''}a JSON "
                     f"{'object' if stack[0] == '}' else 'array'} opened at offset {start}")


def _candidates(text: str) -> tuple[list[str], str | None]:
    """JSON-looking pieces of `text` (fenced blocks first, then balanced {...} / [...] spans, longest first), and
    why the text looks truncated (None if it does not)."""
    fenced = [m.group(2) for m in _FENCE.finditer(text) if m.group(2).strip()]
    spans: list[str] = []
    truncated = None
    i = 0
    while i < len(text):
        if text[i] not in _CLOSE:
            i += 1
            continue
        try:
            end = _balanced(text, i)
        except _Truncated as e:
            truncated = str(e)
            break
        except ValueError:
            i += 1
            continue
        spans.append(text[i:end])
        i = end
    return fenced + sorted(spans, key=len, reverse=True), truncated


def parse_tolerant(text: str) -> TolerantResult:
    """Parse JSON out of model output, reporting which tier produced the value.

    strict: the whole text is JSON. extracted: JSON after removing code fences / chatter around it.
    lenient: needed the lenient grammar (trailing commas, single quotes, unquoted keys, comments,
    True/False/None). raw: nothing parsed; `reason` says why (e.g. truncated).
    """
    try:
        return TolerantResult(json.loads(text), True, "strict")
    except (ValueError, RecursionError):
        pass
    pieces, truncated = _candidates(text)
    for piece in pieces:
        try:
            return TolerantResult(json.loads(piece), True, "extracted")
        except (ValueError, RecursionError):
            continue
    errors = []
    for piece in pieces:
        try:
            return TolerantResult(lenient_loads(piece), True, "lenient")
        except _Truncated as e:
            errors.append(f"truncated: {e}")
        except (ValueError, RecursionError) as e:
            errors.append(f"not JSON: {e}")
    if truncated:
        return TolerantResult(None, False, "raw", f"truncated: {truncated}")
    if not errors:
        return TolerantResult(None, False, "raw", "no JSON object or array in the text")
    return TolerantResult(None, False, "raw", errors[0])


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_IDENT = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]*")
_WORDS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/", "\\": "\\", '"': '"', "'": "'"}


class _Lenient:
    """A small recursive-descent parser for JSON with the usual model slips."""

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def fail(self, what: str) -> ValueError:
        if self.i >= len(self.s):
            return _Truncated(f"the text ends where {what} was expected")
        return ValueError(f"expected {what} at offset {self.i}, found {self.s[self.i:self.i + 12]!r}")

    def ws(self) -> None:
        s = self.s
        while self.i < len(s):
            if s[self.i].isspace():
                self.i += 1
            elif s.startswith("//", self.i) or s.startswith("#", self.i):
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end + 1
            elif s.startswith("/*", self.i):
                end = s.find("*/", self.i + 2)
                self.i = len(s) if end < 0 else end + 2
            else:
                return

    def value(self) -> Any:
        self.ws()
        if self.i >= len(self.s):
            raise self.fail("a value")
        ch = self.s[self.i]
        if ch == "{":
            return self.container("}", self.member, {})
        if ch == "[":
            return self.container("]", self.value, [])
        if ch in "\"'":
            return self.string()
        m = _NUMBER.match(self.s, self.i)
        if m:
            self.i = m.end()
            return json.loads(m.group())
        m = _IDENT.match(self.s, self.i)
        if m and m.group() in _WORDS:
            self.i = m.end()
            return _WORDS[m.group()]
        raise self.fail("a value")

    def container(self, close: str, item: Any, out: Any) -> Any:
        self.i += 1
        while True:
            self.ws()
            if self.i >= len(self.s):
                raise self.fail(repr(close))
            if self.s[self.i] == close:
                self.i += 1
                return out
            got = item()
            if isinstance(out, dict):
                out[got[0]] = got[1]
            else:
                out.append(got)
            self.ws()
            if self.i < len(self.s) and self.s[self.i] == ",":
                self.i += 1  # a trailing comma before the close is fine
            elif self.i < len(self.s) and self.s[self.i] == close:
                continue
            else:
                raise self.fail(f"',' or {close!r}")

    def member(self) -> tuple[str, Any]:
        self.ws()
        if self.i < len(self.s) and self.s[self.i] in "\"'":
            key = self.string()
        else:
            m = _IDENT.match(self.s, self.i)
            if not m:
                raise self.fail("a key")
            key, self.i = m.group(), m.end()
        self.ws()
        if self.i >= len(self.s) or self.s[self.i] != ":":
            raise self.fail("':'")
        self.i += 1
        return key, self.value()

    def string(self) -> str:
        quote, s = self.s[self.i], self.s
        self.i += 1
        out: list[str] = []
        while self.i < len(s):
            ch = s[self.i]
            if ch == quote:
                self.i += 1
                return "".join(out)
            if ch == "\\" and self.i + 1 < len(s):
                nxt = s[self.i + 1]
                if nxt == "u" and self.i + 6 <= len(s):
                    out.append(chr(int(s[self.i + 2:self.i + 6], 16)))
                    self.i += 6
                    continue
                out.append(_ESCAPES.get(nxt, nxt))
                self.i += 2
                continue
            out.append(ch)
            self.i += 1
        raise _Truncated("the text ends inside a string")


def lenient_loads(text: str) -> Any:
    """Parse JSON allowing trailing commas, single quotes, unquoted keys, comments and Python literals."""
    parser = _Lenient(text)
    value = parser.value()
    parser.ws()
    if parser.i != len(parser.s):
        raise ValueError(f"unexpected text after the JSON value at offset {parser.i}")
    return value
