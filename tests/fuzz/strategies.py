"""Hypothesis strategies shared by the fuzz tests: JSON values, JSON Schemas, regexes, EBNF, chat messages."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12))


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON-ish value (NaN and infinities included: Python's json accepts them on the wire)."""
    return st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=max_leaves)


# Regexes that have hurt regex engines (nested quantifiers, huge counters, unbalanced syntax) and plain ones.
PATHOLOGICAL_PATTERNS = [
    "(a+)+b", "(a|aa)*b", "(.*a){20}", "(a{100}){100}", "((a{30}){30}){30}", "(a{1,1000}){1,1000}", "[a-z]{1000}",
    "a{100000}", "a{2,1}", "(", ")", "[", "[z-a]", "a**", "\\", "(?P<x>a)(?P=x)", "(?=a)a", "\\1", "^$", "", ".*",
    "[\\d\\w\\s]+", "\\p{L}+", "\\u0000", "[^\\x00-\\x7f]", "(?i)abc", "a|", "|", "()", "(?:)", "x{,5}",
    "[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}",
]
patterns = st.sampled_from(PATHOLOGICAL_PATTERNS) | st.text(alphabet="ab()[]{}|*+?.^$\\-,0123456789dwsS", max_size=24)

UNSUPPORTED = ["not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
               "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef", "$recursiveRef", "$anchor",
               "unevaluatedProperties", "unevaluatedItems", "propertyNames", "patternProperties", "multipleOf"]
TYPES = ["string", "integer", "number", "boolean", "null", "object", "array"]
FORMATS = ["date", "date-time", "time", "email", "uuid", "uri", "ipv4", "ipv6", "hostname", "byte", "nonsense"]


def _bounds() -> st.SearchStrategy[Any]:
    return st.integers(-3, 12) | st.sampled_from([0, 10**6, 2**63, -(2**63), 1e300, -1e300, 0.5]) | SCALARS


def _leaf_schema() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(TYPES) | st.lists(st.sampled_from(TYPES), max_size=3) | SCALARS,
        "enum": st.lists(SCALARS, max_size=6) | SCALARS,
        "const": SCALARS,
        "pattern": patterns,
        "format": st.sampled_from(FORMATS),
        "minLength": _bounds(), "maxLength": _bounds(),
        "minimum": _bounds(), "maximum": _bounds(), "exclusiveMinimum": _bounds(), "exclusiveMaximum": _bounds(),
        "minItems": _bounds(), "maxItems": _bounds(), "minProperties": _bounds(), "maxProperties": _bounds(),
        "description": st.text(max_size=20),
        "$ref": st.sampled_from(["#", "#/$defs/a", "#/$defs/missing", "#/definitions/a", "http://x/y", "#/", ""]),
    })


def _with_children(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    names = st.text(max_size=6)
    return st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["object", "array"]) | st.sampled_from(TYPES),
        "properties": st.dictionaries(names, children, max_size=4),
        "required": st.lists(names, max_size=4) | SCALARS,
        "additionalProperties": st.booleans() | children,
        "items": children | st.booleans(),
        "prefixItems": st.lists(children, max_size=3),
        "anyOf": st.lists(children, max_size=3), "oneOf": st.lists(children, max_size=3),
        "allOf": st.lists(children, max_size=3),
        "$defs": st.dictionaries(st.sampled_from(["a", "b"]), children, max_size=2),
        "definitions": st.dictionaries(st.just("a"), children, max_size=1),
        **{kw: children | SCALARS for kw in UNSUPPORTED[:6]},
    })


def schemas(max_leaves: int = 10) -> st.SearchStrategy[Any]:
    """Generated JSON Schemas: mostly well-shaped, with unsupported keywords, bad values, refs, garbage leaves."""
    tree = st.recursive(_leaf_schema() | st.booleans(), _with_children, max_leaves=max_leaves)
    return st.one_of(tree, deep_schemas(), wide_schemas(), huge_enums(), json_values(6))


def deep_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """A chain of nested objects (or arrays), 1..120 levels: around and far past the depth limit."""
    def build(levels: int, arrays: bool) -> dict[str, Any]:
        node: dict[str, Any] = {"type": "integer"}
        for _ in range(levels):
            node = {"type": "array", "items": node} if arrays else {"type": "object", "properties": {"a": node}}
        return node
    return st.builds(build, st.integers(1, 120), st.booleans())


def wide_schemas() -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda n, req: {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)},
                                     "required": [f"p{i}" for i in range(n)] if req else []},
                     st.integers(0, 400), st.booleans())


def huge_enums() -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda n, kind: {"enum": [kind(i) for i in range(n)]}, st.integers(0, 3000),
                     st.sampled_from([str, int, lambda i: {"k": i}]))


def response_formats() -> st.SearchStrategy[Any]:
    """OpenAI response_format objects, well- and ill-shaped, and the grammar/regex extensions."""
    spec = st.fixed_dictionaries({}, optional={"name": st.text(max_size=8) | SCALARS, "schema": schemas(),
                                               "strict": st.booleans() | SCALARS})
    return st.one_of(
        st.builds(lambda s: {"type": "json_schema", "json_schema": s}, spec),
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": "nope"}, {}]),
        st.builds(lambda g: {"type": "grammar", "grammar": g}, ebnf() | SCALARS),
        st.builds(lambda r: {"type": "regex", "regex": r}, patterns | SCALARS),
        json_values(6),
    )


EBNF_PIECES = ['root ::= "a"', 'root ::= x\nx ::= "b" x | "b"', 'root ::= [a-z]+', 'root ::= "a"{1000}',
               'root ::= root', 'root ::= x', 'x ::= "a"', 'root ::= ("a" | "b")* "c"', 'root ::= [^\\x00]',
               'root ::= "', 'root ::=', '::= "a"', 'root ::= "a" "b" | ', 'root ::= "\\u0000"', 'root ::= [z-a]',
               'root ::= "a"{2,1}', 'root ::= x{0,99999}\nx ::= "ab"', '']


def ebnf() -> st.SearchStrategy[str]:
    """EBNF grammars: known-tricky ones, joined pieces, and random text over the grammar's alphabet."""
    return (st.sampled_from(EBNF_PIECES)
            | st.lists(st.sampled_from(EBNF_PIECES), min_size=1, max_size=4).map("\n".join)
            | st.text(alphabet='root:=| "ab[]()*+?{},\\-\n^x0123456789', max_size=40))


ROLES = ["system", "developer", "user", "assistant", "tool", "function", "", "USER"]


def content() -> st.SearchStrategy[Any]:
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "x"])},
                                 optional={"text": st.text(max_size=20) | SCALARS, "image_url": json_values(3)})
    return st.text(max_size=40) | st.none() | st.lists(part, max_size=3) | SCALARS


def tool_calls() -> st.SearchStrategy[Any]:
    fn = st.fixed_dictionaries({"name": st.text(max_size=8) | SCALARS},
                               optional={"arguments": st.sampled_from(['{"a": 1}', "{", "[]", "null", ""])
                                         | st.text(max_size=10) | SCALARS})
    call = st.fixed_dictionaries({"function": fn}, optional={"id": st.text(max_size=6), "type": st.just("function")})
    return st.lists(call, max_size=2) | SCALARS


def messages() -> st.SearchStrategy[Any]:
    message = st.fixed_dictionaries({"role": st.sampled_from(ROLES) | SCALARS}, optional={
        "content": content(), "name": st.text(max_size=6) | SCALARS, "tool_calls": tool_calls(),
        "tool_call_id": st.text(max_size=6) | SCALARS})
    return st.lists(message, max_size=5) | SCALARS | st.lists(SCALARS, max_size=2)


def tools() -> st.SearchStrategy[Any]:
    fn = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "f", "bad name!", ""]) | st.text(max_size=6)},
                               optional={"description": st.text(max_size=10) | SCALARS,
                                         "parameters": schemas(6), "strict": st.booleans()})
    tool = st.fixed_dictionaries({"function": fn}, optional={"type": st.sampled_from(["function", "code"])})
    return st.lists(tool, max_size=3) | SCALARS
