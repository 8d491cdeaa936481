"""The regex bound (issue 29 finding 6): a malformed or too costly pattern is refused before xgrammar sees it, in
one line naming the limit; well-formed patterns within the bound are those xgrammar (the reference) accepts; and
through a real server the nested-repetition pattern is refused while a plain request is served."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from edgellm.errors import GrammarError
from edgellm.structured.pattern_bound import (
    MAX_NESTED_REPEATS,
    MAX_REPEAT_PRODUCT,
    check_grammar_format,
    check_regex_format,
    pattern_cost,
)

NESTED = "((((b{0,99}){0,99}){0,99}){0,99}){0,99}"  # the finding's pattern: minutes per token in xgrammar's matcher

WITHIN = [r"\d{4}-\d{2}-\d{2}", r"(\d{1,3}\.){3}\d{1,3}", "[a-z]{1,1000}", "(b{0,300}){0,300}", "(b+)+",
          "((b+)+)+", "(?:ab|cd){2,5}", "(?<year>[0-9]{4})", "[^]a]", "a|", "x{1,}", r"\{\}", "a{2}?"]
MALFORMED = ["(a", "a)", "[a", "\\", "*a", "a**", "a{2,1}", "a{", "a{b}", "{a", "[]", "(?=a)b", "(?i)a",
             "a{1,2}{3}", "a{ 2}"]


@pytest.mark.parametrize("pattern", WITHIN)
def test_patterns_within_the_bound_pass_and_xgrammar_accepts_them(pattern: str) -> None:
    xgr = pytest.importorskip("xgrammar")
    check_regex_format(pattern)
    xgr.Grammar.from_regex(pattern)  # the reference parser agrees the pattern is well formed


@pytest.mark.parametrize("pattern", MALFORMED)
def test_malformed_patterns_are_refused_as_xgrammar_refuses_them(pattern: str) -> None:
    xgr = pytest.importorskip("xgrammar")
    with pytest.raises(GrammarError, match="^invalid regex: .* at position \\d+$"):
        check_regex_format(pattern)
    with pytest.raises(Exception):
        xgr.Grammar.from_regex(pattern)


def test_the_cost_is_read_from_the_parse() -> None:
    assert (pattern_cost(NESTED).depth, pattern_cost(NESTED).product) == (5, 99 ** 5)
    assert (pattern_cost(r"(\d{1,3}\.){3}").depth, pattern_cost(r"(\d{1,3}\.){3}").product) == (2, 9)
    assert pattern_cost("(a|b{0,7}|(c{0,3}){0,4})").product == 12
    assert pattern_cost("(b*)*").depth == 0  # unbounded repetitions need no counters


@pytest.mark.parametrize(("pattern", "reason"), [
    (NESTED, f"nested 5 deep, over the limit of {MAX_NESTED_REPEATS}"),
    ("(((b{0,9}){0,9}){0,9}){0,9}", f"nested 4 deep, over the limit of {MAX_NESTED_REPEATS}"),
    ("(b{0,400}){0,400}", f"multiply to 160000, over the limit of {MAX_REPEAT_PRODUCT}"),
])
def test_costly_patterns_are_refused_naming_the_limit(pattern: str, reason: str) -> None:
    with pytest.raises(GrammarError, match=reason) as info:
        check_regex_format(pattern)
    assert "\n" not in str(info.value)


def test_a_schema_pattern_is_held_to_the_same_bound(tmp_path: Path) -> None:
    from edgellm.structured.grammar import compile_format, grammar_cache
    from edgellm.response_format import ResponseFormat
    from tests.support.tiny_chat import tiny_chat_engine

    engine = tiny_chat_engine(tmp_path)
    cache = grammar_cache(engine.tokenizer, engine.config.model.vocab_size)
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": NESTED}}, "required": ["s"]}
    with pytest.raises(GrammarError, match="schema pattern refused: bounded repetitions nested 5 deep"):
        compile_format(cache, ResponseFormat("json_schema", schema=schema))


# ---- through the server --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("fastapi")
    from tests.support.tiny_chat import tiny_chat_engine
    from tests.serve.test_serve_api import running_server, wait_ready

    engine = tiny_chat_engine(tmp_path_factory.mktemp("tiny"))
    with running_server(lambda: engine, timeout_s=60) as url:
        wait_ready(url)
        yield url


def test_the_nested_regex_is_refused_while_a_plain_request_is_served(base: str) -> None:
    import httpx

    replies: dict[str, Any] = {}

    def post(name: str, **extra: Any) -> None:
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "t1"}], "max_tokens": 24, **extra}
        replies[name] = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)

    regex = threading.Thread(target=post, args=("regex",),
                             kwargs={"response_format": {"type": "regex", "regex": NESTED}})
    plain = threading.Thread(target=post, args=("plain",))
    regex.start()
    plain.start()
    regex.join(150)
    plain.join(150)
    assert replies["regex"].status_code == 400, replies["regex"].text
    error = replies["regex"].json()["error"]
    assert error["code"] == "invalid_grammar" and "nested 5 deep, over the limit of 2" in error["message"]
    assert replies["plain"].status_code == 200, replies["plain"].text
    assert replies["plain"].json()["choices"][0]["message"]["content"] is not None


# ---- EBNF grammars --------------------------------------------------------------------------------------------
JSON_EBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ws
ws     ::= [ \t\n]{0,20}
"""


@pytest.mark.parametrize(("grammar", "reason"), [
    ('root ::= ((((("b"){0,99}){0,99}){0,99}){0,99})', "nested 4 deep"),
    ('root ::= a{0,9}\na ::= b{0,9}\nb ::= c{0,9}\nc ::= "x"', "nested 3 deep"),  # through rule references
    ('root ::= item{0,400}\nitem ::= "x"{0,400}', "multiply to 160000"),
])
def test_costly_grammars_are_refused_through_their_rules(grammar: str, reason: str) -> None:
    with pytest.raises(GrammarError, match=f"^grammar refused: .*{reason}"):
        check_grammar_format(grammar)


def test_ordinary_and_recursive_grammars_pass_and_xgrammar_accepts_them() -> None:
    xgr = pytest.importorskip("xgrammar")
    for grammar in (JSON_EBNF, 'root ::= x\nx ::= "(" x{0,3} ")" | "y"', 'root ::= "a" | [0-9]+ ("," root)*'):
        check_grammar_format(grammar)
        xgr.Grammar.from_ebnf(grammar)
