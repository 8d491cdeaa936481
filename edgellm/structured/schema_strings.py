"""String keywords the grammar cannot combine, rewritten into one `pattern` that implies them all (a narrowing).

xgrammar applies one of `pattern` / `format` / `minLength`+`maxLength` per string, and no `not`. The grammar matches
a pattern against the whole string (narrower than JSON Schema's search), so a rewritten pattern is anchored:

- `pattern` with `minLength`/`maxLength`: dropped when the pattern's own lengths already fit (exact); otherwise the
  pattern's last unbounded repeat gets the counts that keep every match within the lengths (`^[a-z](-?[a-z])*$`
  with `maxLength: 39` → `^[a-z](-?[a-z]){0,19}$`);
- `pattern` with a `format`: a format jsonschema does not assert (`uri` without `rfc3987`, ...) is an annotation
  there; `date` becomes the calendar dates of 1900-2099 where the pattern accepts every one of them;
- `format: regex` (without a pattern): strings of letters, digits and ` _./:-`, which every regex dialect reads as
  literals (or `.`), so each is a valid ECMA-262 regex; next to a pattern, the pattern's strings made of those;
- two patterns (a merge): see intersect_patterns;
- `not: {pattern: "^(when|unless)$"}` (a few literal words): strings longer than each word;
- `not: {pattern: P}` (several, or an `anyOf` of them): when every match of P must contain one character of a set
  (a literal or a plain class P cannot skip), strings without those characters — `^[^set]*$`, or the string's own
  pattern with every class, `.` and literal narrowed to leave them out.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
from re import _parser as sre_parse  # type: ignore[attr-defined]
from collections.abc import Set as AbstractSet
from typing import Any

import jsonschema

SAFE_REGEX = "[A-Za-z0-9 _./:-]*"
# Formats the grammar enforces (the others are annotations, or refused by schema_support.check_schema).
SUPPORTED_FORMATS = frozenset({
    "date", "date-time", "time", "duration", "email", "uuid", "uri", "uri-reference", "uri-template",
    "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer",
})
_SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 _./:-")
# Formats some draft of the installed jsonschema asserts (the others are annotations, as JSON Schema defines format).
ASSERTED = frozenset().union(*(cls.FORMAT_CHECKER.checkers for cls in (
    jsonschema.Draft4Validator, jsonschema.Draft6Validator, jsonschema.Draft7Validator,
    jsonschema.Draft201909Validator, jsonschema.Draft202012Validator)))
# Calendar dates of 1900-2099 (a part of format "date", for a date next to a pattern that accepts all of them).
_MONTH_DAY = ("((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
              "|02-(0[1-9]|1[0-9]|2[0-8]))")
RECENT_DATE = f"((19|20)[0-9]{{2}}-{_MONTH_DAY}|((19|20)(0[48]|[2468][048]|[13579][26])|2000)-02-29)"
_PLAIN_LABEL = "[A-Za-z0-9]{1,63}"  # a label no IDNA rule rejects (no hyphen; 3 of them stay below 253 characters)
_UNBOUNDED = 1 << 30
_QUANT = re.compile(r"(\*|\+|\?|\{\d*(,\d*)?\})\??")


def narrow_strings(node: dict[str, Any]) -> list[tuple[str, str]]:
    """Rewrite `node`'s string keywords in place where one anchored pattern can imply them (see module doc); the
    (keyword, how) of each rewrite that narrowed."""
    narrowed: list[tuple[str, str]] = []
    if isinstance(node.get("pattern"), str) and isinstance(node.get("format"), str):
        if node["format"] not in ASSERTED:
            del node["format"]  # an annotation where jsonschema does not assert it: the pattern is the constraint
        elif node["format"] == "date" and _recent_dates_match(node["pattern"]):
            del node["format"]
            node["pattern"] = f"^{RECENT_DATE}$"
            narrowed.append(("format", "a date next to the pattern is held to the calendar dates of 1900-2099"))
    if node.get("format") == "idn-email":  # (RFC 6531 widens RFC 5321: every ASCII address is one)
        node["format"] = "email"
        narrowed.append(("format", "an internationalized email is held to the ASCII addresses of format email"))
    if node.get("format") == "idn-hostname" and "pattern" not in node:  # (valid A-labels and U-labels left out)
        del node["format"]
        node["pattern"] = f"^{_PLAIN_LABEL}(\\.{_PLAIN_LABEL}){{0,2}}$"
        narrowed.append(("format", "an internationalized hostname is held to 1-3 labels of ASCII letters and digits"))
    if node.get("format") == "regex" and "pattern" not in node:
        del node["format"]
        node["pattern"] = f"^{SAFE_REGEX}$"
        narrowed.append(("format", "a regex is held to letters, digits and ' _./:-'"))
    elif node.get("format") == "regex" and isinstance(node.get("pattern"), str):
        body = _within(_body(node["pattern"]), _SAFE_CHARS)  # the pattern's strings made of those characters only
        if body is not None:
            del node["format"]
            node["pattern"] = f"^({body})$"
            narrowed.append(("format", "a regex is held to letters, digits and ' _./:-'"))
    banned = _excluded_chars(node.get("not"))
    if banned and "format" not in node:
        pattern = f"^[^{_class(banned)}]*$" if "pattern" not in node else _anchored_without(node["pattern"], banned)
        if pattern is not None:
            del node["not"]
            node["pattern"] = pattern
            node.setdefault("type", "string")
            narrowed.append(("not", f"strings without {''.join(sorted(banned))!r}"))
    words = _literal_words(node.get("not"))
    if words and "format" not in node:  # not one of a few names: longer than each of them (a narrowing)
        pattern = _bounded(node.get("pattern", "^.*$"), max(map(len, words)) + 1, node.get("maxLength"))
        if pattern is not None:
            del node["not"]
            node.pop("maxLength", None)
            node["pattern"] = pattern
            node.setdefault("type", "string")
            narrowed.append(("not", f"strings longer than {max(map(len, words))} characters"))
    if isinstance(node.get("pattern"), str) and ("minLength" in node or "maxLength" in node):
        pattern = _bounded(node["pattern"], node.get("minLength", 0), node.get("maxLength"))
        if pattern is not None:
            if not _bounded_exactly(node["pattern"], pattern):
                narrowed.append(("maxLength" if "maxLength" in node else "minLength", f"the pattern's repeat is "
                                 f"counted instead: {pattern!r}"))
            node["pattern"] = pattern
            node.pop("minLength", None)
            node.pop("maxLength", None)
    return narrowed


def whole_string(pattern: str) -> bool:
    """Does matching `pattern` against the whole string (as the grammar does) equal JSON Schema's search?"""
    try:
        items = list(sre_parse.parse(pattern))
    except (re.error, RecursionError):
        return False
    at = sre_parse.AT
    return bool(items) and items[0] == (at, sre_parse.AT_BEGINNING) and items[-1] in (
        (at, sre_parse.AT_END), (at, sre_parse.AT_END_STRING))


def _bounded_exactly(original: str, bounded: str) -> bool:
    """Is the counted pattern from _bounded the same language as the original with its lengths? (the original
    already within them, or one fixed-width atom repeated after a fixed-width prefix)"""
    if bounded == f"^{_body(original)}$" and whole_string(original):
        return True
    items = _items(_body(bounded))
    if not items:
        return False
    prefix = "".join(a + q for a, q in items[:-1])
    head, one = _width(prefix) if prefix else (0, 0), _width(items[-1][0])
    return head is not None and one is not None and head[0] == head[1] and one[0] == one[1]


def without_any_of(pattern: str) -> str | None:
    """A pattern for a part of the strings `pattern` (searched) does not match: those without any character that
    every match must contain (`^[^@]*$` for `^[^@]+@[^@]+$`); None when no such set is found."""
    chars = _mandatory(pattern)
    return f"^[^{_class(chars)}]*$" if chars else None


def intersect_patterns(a: str, b: str) -> str | None:
    """A pattern whose whole-string matches match both `a` and `b` (searched, as JSON Schema does), or None:
    - one is an exclusion `^[^set]*$`: the other with the set's characters left out of every atom, free characters
      outside the set before / after it where it is not anchored there;
    - one is anchored at the start only (`^https?://`), the other at the end only (`\\w\\.ya?ml$`): the first, any
      characters, then the second (`^https?://.*\\w\\.ya?ml$`).
    Both are narrowings (exact when the matches cannot overlap)."""
    for x, y in ((a, b), (b, a)):
        if _is_exclusion(y) and not _is_exclusion(x):
            banned = _class_members(y[3:-3])
            body = _without(_body(x), set(banned)) if banned else None
            if body is None:
                return None
            free = f"[^{y[3:-3]}]*"
            return (f"^{'' if x.startswith('^') else free}({body}){'' if _ends_anchored(x) else free}$")
        if x.startswith("^") and not _ends_anchored(x) and _ends_anchored(y) and not y.startswith("^") and (
                len(_alternatives(_body(x)) or []) == 1 and len(_alternatives(_body(y)) or []) == 1):
            return f"^{_body(x)}.*{_body(y)}$"
    return None


def _is_exclusion(pattern: str) -> bool:
    return re.fullmatch(r"\^\[\^((?:\\.|[^\]\\])+)\]\*\$", pattern) is not None


def _ends_anchored(pattern: str) -> bool:
    return pattern.endswith("$") and not pattern.endswith("\\$")


@functools.lru_cache(maxsize=64)
def _class_members(content: str) -> frozenset[str] | None:
    """The characters of the Basic Multilingual Plane in the class `[content]` (its own `\\u` escapes read)."""
    try:
        compiled = re.compile(f"[{content}]")
    except re.error:
        return None
    return frozenset(chr(c) for c in range(0x10000) if not 0xD800 <= c < 0xE000 and compiled.fullmatch(chr(c)))


def _within(body: str, allowed: frozenset[str]) -> str | None:
    """`body` with every atom narrowed to the `allowed` characters (None where an atom cannot be read or keeps none)."""
    alternatives = _alternatives(body)
    if not alternatives:
        return None
    out = []
    for alt in alternatives:
        items = _items(alt)
        if items is None:
            return None
        parts = []
        for atom, quant in items:
            members: AbstractSet[str] | None
            chars: str | AbstractSet[str] | None
            if atom in ("^", "$"):
                chars = atom
            elif atom.startswith("("):
                inner = _within(atom[1:-1].removeprefix("?:"), allowed)
                chars = None if inner is None else f"({inner})"
            elif atom == ".":
                chars = allowed
            elif atom.startswith("[^"):
                members = _class_members(atom[2:-1])
                chars = None if members is None else allowed - members
            else:
                members = _chars(atom)
                chars = None if members is None else allowed & members
            if not chars:
                return None
            parts.append((chars if isinstance(chars, str) else f"[{_class(chars)}]") + quant)
        out.append("".join(parts))
    return "|".join(out)


def _literal_words(neg: Any) -> list[str] | None:
    """The words of a negated `^(word|word)$` pattern (letters, digits, `_` and `-` only), else None."""
    m = re.fullmatch(r"\^\((?:\?:)?([\w-]+(?:\|[\w-]+)*)\)\$|\^([\w-]+)\$", neg.get("pattern", "")) if isinstance(
        neg, dict) and set(neg) <= {"pattern", "type"} and neg.get("type", "string") == "string" else None
    return (m.group(1) or m.group(2)).split("|") if m else None


def _anchored_without(pattern: Any, banned: set[str]) -> str | None:
    if not isinstance(pattern, str):
        return None
    body = _without(_body(pattern), banned)
    if body is None:
        return None
    return f"^{body}$" if len(_alternatives(body) or []) == 1 else f"^({body})$"


@functools.lru_cache(maxsize=64)
def _recent_dates_match(pattern: str) -> bool:
    """Does `pattern` (searched, as JSON Schema does) match every date of 1900-2099? (73,000 strings)"""
    try:
        compiled = re.compile(pattern)
    except re.error:
        return False
    day, end, one = datetime.date(1900, 1, 1), datetime.date(2099, 12, 31), datetime.timedelta(days=1)
    while day <= end:
        if not compiled.search(day.isoformat()):
            return False
        day += one
    return True


def _width(body: str) -> tuple[int, int] | None:
    try:
        low, high = sre_parse.parse(body).getwidth()
    except (re.error, RecursionError, OverflowError):
        return None
    return low, min(high, _UNBOUNDED)


def _body(pattern: str) -> str:
    """The pattern without its outer anchors (the grammar matches whole strings anyway)."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    return body


def _bounded(pattern: str, low: Any, high: Any) -> str | None:
    """An anchored pattern inside `pattern`'s whole-string matches whose every match has low..high characters."""
    if not isinstance(low, int) or (high is not None and not isinstance(high, int)):
        return None
    body = _body(pattern)
    if not pattern.startswith("^") and body.startswith(".*") and len(body) > 2:
        body = body[2:]  # a search for `.*X` finds what a search for X does
    width = _width(body)
    if width is None:
        return None
    if width[0] >= low and (high is None or width[1] <= high):
        return f"^{body}$"
    items = _items(body)
    if not items or not _QUANT.fullmatch(items[-1][1]) or items[-1][1].startswith("?"):
        return None
    atom, quant = items[-1]
    prefix = "".join(a + q for a, q in items[:-1])
    least = {"*": 0, "+": 1}.get(quant.rstrip("?"))
    if least is None:
        counts = re.fullmatch(r"\{(\d*),(\d*)\}\??", quant)
        if not counts or counts.group(2):
            return None
        least = int(counts.group(1) or 0)
    head, one = _width(prefix) if prefix else (0, 0), _width(atom)
    if head is None or one is None or one[0] < 1 or head[1] >= _UNBOUNDED or one[1] >= _UNBOUNDED:
        return None
    n_low = max(least, math.ceil((low - head[0]) / one[0]))
    n_high = None if high is None else (high - head[1]) // one[1]
    if n_high is not None and n_low > n_high:
        return None
    body = f"{prefix}{atom}{{{n_low},{'' if n_high is None else n_high}}}"
    width = _width(body)
    if width is None or width[0] < low or (high is not None and width[1] > high):
        return None
    return f"^{body}$"


def _items(body: str) -> list[tuple[str, str]] | None:
    """The top-level (atom, quantifier) sequence of a regex body; None for a top-level `|` or a malformed body."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        end: int | None
        if c == "|":
            return None
        if c == "\\":
            end = i + 2
        elif c == "[":
            end = _class_end(body, i)
        elif c == "(":
            end = _group_end(body, i)
        else:
            end = i + 1
        if end is None or end > len(body):
            return None
        quant = _QUANT.match(body, end)
        stop = quant.end() if quant else end
        out.append((body[i:end], body[end:stop]))
        i = stop
    return out


def _class_end(body: str, start: int) -> int | None:
    i = start + 1
    if i < len(body) and body[i] == "^":
        i += 1
    if i < len(body) and body[i] == "]":
        i += 1
    while i < len(body):
        if body[i] == "\\":
            i += 2
            continue
        if body[i] == "]":
            return i + 1
        i += 1
    return None


def pattern_marks(body: str, start: int = 0) -> list[tuple[int, str, int]] | None:
    """(position, character, group depth after it) of each `(`, `)`, `|` outside classes and escapes, from
    `start`; None for an unterminated class."""
    out, depth, i = [], 0, start
    while i < len(body):
        c = body[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            end = _class_end(body, i)
            if end is None:
                return None
            i = end
            continue
        if c in "()|":
            depth += (c == "(") - (c == ")")
            out.append((i, c, depth))
        i += 1
    return out


def _group_end(body: str, start: int) -> int | None:
    return next((i + 1 for i, c, depth in pattern_marks(body, start) or [] if c == ")" and depth == 0), None)


def _excluded_chars(neg: Any) -> set[str] | None:
    """Characters one of which every match of the negated pattern(s) must contain (None: no such set found)."""
    if not isinstance(neg, dict):
        return None
    if set(neg) == {"pattern"} and isinstance(neg["pattern"], str):
        return _mandatory(neg["pattern"])
    if set(neg) == {"anyOf"} and isinstance(neg["anyOf"], list) and neg["anyOf"]:
        sets = [_excluded_chars(sub) for sub in neg["anyOf"]]
        return None if any(s is None for s in sets) else set().union(*sets)  # type: ignore[arg-type]
    return None


def _alternatives(body: str) -> list[str] | None:
    """A regex body split at its top-level `|`."""
    marks = pattern_marks(body)
    if marks is None:
        return None
    cuts = [i for i, c, depth in marks if c == "|" and depth == 0]
    return [body[a + 1 if a >= 0 else 0:b] for a, b in zip([-1, *cuts], [*cuts, len(body)])]


def _mandatory(body: str) -> set[str] | None:
    """The smallest set of characters one of which every match of `body` (searched, unanchored) contains."""
    alternatives = _alternatives(body)
    if alternatives is None:
        return None
    found: set[str] = set()
    for alt in alternatives:
        items = _items(alt.removeprefix("^"))
        best = None
        for atom, quant in items or []:
            if quant.startswith(("?", "*", "{0", "{,")):
                continue
            chars = _mandatory(atom[1:-1].removeprefix("?:")) if atom.startswith("(") else _chars(atom)
            if chars and (best is None or len(chars) < len(best)):
                best = chars
        if best is None:
            return None
        found |= best
    return found


def _chars(atom: str) -> set[str] | None:
    """Every character a one-character atom (a literal, an escaped punctuation, a plain class) can match."""
    if atom in ("$", "^", ".") or (atom.startswith("\\") and (len(atom) != 2 or atom[1].isalnum())):
        return None
    if atom.startswith("["):
        if atom.startswith("[^") or re.search(r"\\[pPsSwWdDbBuxc0-9]", atom):
            return None  # negated, or a class escape whose members differ between regex dialects
        try:
            compiled = re.compile(atom)
        except re.error:
            return None
        return {chr(c) for c in range(0x10000) if not 0xD800 <= c < 0xE000 and compiled.fullmatch(chr(c))}
    return {atom[-1]} if len(atom) <= 2 else None


def _class(chars: AbstractSet[str]) -> str:
    return "".join(f"\\u{ord(c):04x}" if not c.isalnum() else c for c in sorted(chars))


def _without(body: str, banned: set[str]) -> str | None:
    """`body` with every atom narrowed so that no match contains a banned character (None where it cannot)."""
    alternatives = _alternatives(body)
    if alternatives is None:
        return None
    out = []
    for alt in alternatives:
        items = _items(alt)
        if items is None:
            return None
        parts = []
        for atom, quant in items:
            if atom in ("^", "$"):
                parts.append(atom + quant)
                continue
            if atom.startswith("("):
                inner = _without(atom[1:-1], banned)
                if inner is None:
                    return None
                parts.append(f"({inner}){quant}")
                continue
            if atom == ".":
                narrowed = f"[^\\n\\r\\u2028\\u2029{_class(banned)}]"
            elif atom.startswith("[^") and not re.search(r"\\[pPsSwWdDbB]", atom):
                narrowed = f"[^{atom[2:-1]}{_class(banned)}]"
            elif atom in ("\\w", "\\d") and not any(re.fullmatch(atom, c) for c in banned):
                narrowed = atom  # (Python's \w / \d hold ECMA-262's: no banned character in either)
            else:
                chars = _chars(atom)
                if chars is None:
                    return None
                if not chars - banned or (chars & banned and len(chars - banned) > 512):
                    return None  # nothing left, or too large a class to spell out
                narrowed = atom if not chars & banned else f"[{_class(chars - banned)}]"
            parts.append(narrowed + quant)
        out.append("".join(parts))
    return "|".join(out)
