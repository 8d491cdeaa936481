"""A regex or an EBNF grammar checked before xgrammar sees it: a regex's syntax, and for both a bound on the
matcher's work their repetitions imply.

xgrammar matches a bounded repetition `x{m,n}` with a counter per level, so nested bounded repetitions multiply
the states its matcher tracks per token: `((((b{0,99}){0,99}){0,99}){0,99}){0,99}` compiles in milliseconds but
then spends seconds, then minutes, on each generated token. The bound is read from the pattern's parse, in pure
Python (no xgrammar, no torch), so such a pattern, and a malformed one, are refused in milliseconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgellm.errors import GrammarError

# Bounded repetitions (`{n}`, `{m,n}`, `{m,}`) nested inside one another, at most (`(\d{1,3}\.){3}` is 2).
MAX_NESTED_REPEATS = 2
# The product of the repetition counts along one nesting (`(a{0,300}){0,300}` is 90000), at most.
MAX_REPEAT_PRODUCT = 100_000
# Digits of a repetition count read before the pattern is refused (xgrammar's counts are 32-bit).
_MAX_COUNT_DIGITS = 9


@dataclass(frozen=True)
class PatternCost:
    """What the bound measures: the deepest nesting of bounded repetitions and the largest count product."""

    depth: int = 0
    product: int = 1


def _is_count(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _worse(a: PatternCost, b: PatternCost) -> PatternCost:
    return PatternCost(max(a.depth, b.depth), max(a.product, b.product))


class _Parser:
    """A recursive-descent reading of the regex dialect xgrammar accepts, for structure only."""

    def __init__(self, pattern: str) -> None:
        self.text = pattern
        self.pos = 0

    def fail(self, reason: str) -> GrammarError:
        return GrammarError(f"invalid regex: {reason} at position {self.pos}")

    def alternation(self, depth: int) -> PatternCost:
        cost = self.sequence(depth)
        while self.pos < len(self.text) and self.text[self.pos] == "|":
            self.pos += 1
            cost = _worse(cost, self.sequence(depth))
        return cost

    def sequence(self, depth: int) -> PatternCost:
        cost = PatternCost()
        while self.pos < len(self.text) and self.text[self.pos] not in "|)":
            cost = _worse(cost, self.quantified(depth))
        return cost

    def quantified(self, depth: int) -> PatternCost:
        char = self.text[self.pos]
        if char in "*+?{":
            raise self.fail(f"nothing to repeat before {char!r}")
        inner = self.atom(depth)
        if self.pos >= len(self.text) or self.text[self.pos] not in "*+?{":
            return inner
        if self.text[self.pos] == "{":
            low, high = self._count()
            times = max(low, high or 0)
            if times > 1:
                inner = PatternCost(inner.depth + 1, inner.product * times)
        else:
            self.pos += 1
        if self.pos < len(self.text) and self.text[self.pos] == "?":  # lazy quantifier
            self.pos += 1
        if self.pos < len(self.text) and self.text[self.pos] in "*+?{":
            raise self.fail("two repetition operators in a row")
        return inner

    def atom(self, depth: int) -> PatternCost:
        char = self.text[self.pos]
        if char == "(":
            start = self.pos
            self.pos += 1
            if self.text.startswith("?:", self.pos):
                self.pos += 2
            elif self.text.startswith("?<", self.pos) and self.text[self.pos + 2:self.pos + 3] not in ("=", "!"):
                close = self.text.find(">", self.pos)
                if close < 0 or not self.text[self.pos + 2:close].isidentifier():
                    raise self.fail("invalid named group")
                self.pos = close + 1
            elif self.text.startswith("?", self.pos):
                raise self.fail("lookarounds and group flags are not supported")
            cost = self.alternation(depth + 1)
            if self.pos >= len(self.text):
                self.pos = start
                raise self.fail("the parenthesis is not closed")
            self.pos += 1
            return cost
        if char == "[":
            self._skip_class()
        elif char == "\\":
            if self.pos + 1 >= len(self.text):
                raise self.fail("the pattern ends in a lone backslash")
            self.pos += 2
        else:
            self.pos += 1
        return PatternCost()

    def _skip_class(self) -> None:
        start = self.pos
        self.pos += 1
        if self.text.startswith("^", self.pos):
            self.pos += 1
        elif self.text.startswith("]", self.pos):
            raise self.fail("empty character class")
        while self.pos < len(self.text) and self.text[self.pos] != "]":
            self.pos += 2 if self.text[self.pos] == "\\" else 1
        if self.pos >= len(self.text):
            self.pos = start
            raise self.fail("the character class is not closed")
        self.pos += 1

    def _count(self) -> tuple[int, int | None]:
        """Read `{n}`, `{m,}` or `{m,n}` at the cursor: (m, n or None when unbounded)."""
        end = self.text.find("}", self.pos)
        low, comma, high = self.text[self.pos + 1:end].partition(",") if end > 0 else ("", "", "")
        if not _is_count(low) or not (_is_count(high) or high == ""):
            raise self.fail("invalid repetition count")
        if len(low) > _MAX_COUNT_DIGITS or len(high) > _MAX_COUNT_DIGITS:
            raise self.fail(f"a repetition count has over {_MAX_COUNT_DIGITS} digits")
        counts = (int(low), int(low)) if not comma else (int(low), int(high) if high else None)
        if counts[1] is not None and counts[0] > counts[1]:
            raise self.fail(f"repetition {{{low},{high}}} has its minimum above its maximum")
        self.pos = end + 1
        return counts


def pattern_cost(pattern: str) -> PatternCost:
    """The nesting and count product of `pattern`'s bounded repetitions. Raises GrammarError when it does not
    parse (unclosed groups or classes, a quantifier with nothing to repeat, a stray `)`)."""
    parser = _Parser(pattern)
    cost = parser.alternation(0)
    if parser.pos < len(pattern):  # only a `)` stops the top level early
        raise parser.fail("unmatched closing parenthesis")
    return cost


def check_pattern(pattern: str, *, what: str = "regex", syntax: bool = True) -> None:
    """Refuse (GrammarError, one line) a `pattern` whose repetitions exceed the bound, or, with `syntax`, that does
    not parse (without it, a pattern this reading cannot parse is left to xgrammar's own message)."""
    try:
        cost = pattern_cost(pattern)
    except GrammarError as e:
        if not syntax:
            return
        raise GrammarError(str(e).replace("invalid regex", f"invalid {what}", 1)) from None
    _check_cost(cost, what)


def _check_cost(cost: PatternCost, what: str) -> None:
    if cost.depth > MAX_NESTED_REPEATS:
        raise GrammarError(
            f"{what} refused: bounded repetitions nested {cost.depth} deep, over the limit of {MAX_NESTED_REPEATS} "
            "(the matcher's work per token multiplies with each level); flatten the pattern")
    if cost.product > MAX_REPEAT_PRODUCT:
        raise GrammarError(
            f"{what} refused: nested repetition counts multiply to {cost.product}, over the limit of "
            f"{MAX_REPEAT_PRODUCT}; use smaller counts or an unbounded repetition (*, +)")


def check_regex_format(regex: object) -> str:
    """The checks of a `regex` response format that need no xgrammar: a non-empty pattern, well formed, in bound
    (returned, as a str)."""
    if not isinstance(regex, str) or not regex:
        raise GrammarError("regex needs a non-empty regular expression")
    check_pattern(regex)
    return regex


_EBNF_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<define>::=)
  | (?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<name>[A-Za-z_][A-Za-z0-9_.-]*)
  | (?P<op>[()|*+?])
""", re.VERBOSE)


def _ebnf_tokens(text: str) -> list[tuple[str, str]] | None:
    """(kind, text) tokens of an EBNF grammar; None when it holds syntax this reading does not know."""
    tokens, pos = [], 0
    while pos < len(text):
        match = _EBNF_TOKEN.match(text, pos)
        if match is None:
            return None
        kind = match.lastgroup or ""
        if kind != "space":
            tokens.append((kind, match.group(0)))
        pos = match.end()
    return tokens


class _GrammarReader:
    """The repetition cost of each rule of an EBNF grammar, a rule reference costing what its rule costs."""

    def __init__(self, rules: dict[str, list[tuple[str, str]]]) -> None:
        self.rules = rules
        self.tokens: list[tuple[str, str]] = []
        self.pos = 0
        self.costs: dict[str, PatternCost] = {}
        self.visiting: set[str] = set()

    def rule(self, name: str) -> PatternCost:
        if name in self.costs:
            return self.costs[name]
        if name in self.visiting or name not in self.rules:  # recursion or an unknown name: no counters of its own
            return PatternCost()
        self.visiting.add(name)
        self.tokens, self.pos = self.rules[name], 0  # the caller keeps its own place (expression)
        cost = self.expression()
        self.visiting.discard(name)
        self.costs[name] = cost
        return cost

    def expression(self) -> PatternCost:
        cost = PatternCost()
        while self.pos < len(self.tokens) and self.tokens[self.pos][1] != ")":
            kind, text = self.tokens[self.pos]
            self.pos += 1
            if text == "|" and kind == "op":
                continue
            if text == "(":
                inner = self.expression()
                self.pos += 1  # the closing parenthesis
            elif kind == "name":
                tokens, pos = self.tokens, self.pos
                inner = self.rule(text)
                self.tokens, self.pos = tokens, pos
            else:
                inner = PatternCost()
            if self.pos < len(self.tokens) and self.tokens[self.pos][0] == "count":
                numbers = [int(n) for n in re.findall(r"\d+", self.tokens[self.pos][1])]
                self.pos += 1
                if max(numbers) > 1:
                    inner = PatternCost(inner.depth + 1, inner.product * max(numbers))
            elif self.pos < len(self.tokens) and self.tokens[self.pos][1] in ("*", "+", "?"):
                self.pos += 1
            cost = _worse(cost, inner)
        return cost


def grammar_cost(ebnf: str) -> PatternCost | None:
    """The deepest nesting and largest count product of bounded repetitions in an EBNF grammar, through rule
    references; None when the grammar uses syntax this reading does not know (xgrammar then judges it alone)."""
    tokens = _ebnf_tokens(ebnf)
    if tokens is None:
        return None
    rules: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for i, token in enumerate(tokens):
        if token[0] == "name" and i + 1 < len(tokens) and tokens[i + 1][0] == "define":
            current = rules.setdefault(token[1], [])
        elif token[0] != "define" and current is not None:
            current.append(token)
    if "root" not in rules:
        return None
    return _GrammarReader(rules).rule("root")


def check_grammar_format(ebnf: object) -> str:
    """The checks of an EBNF `grammar` response format that need no xgrammar: non-empty text, repetitions in bound
    (returned, as a str)."""
    if not isinstance(ebnf, str) or not ebnf.strip():
        raise GrammarError("grammar needs EBNF text with a `root` rule")
    cost = grammar_cost(ebnf)
    if cost is not None:
        _check_cost(cost, "grammar")
    return ebnf
