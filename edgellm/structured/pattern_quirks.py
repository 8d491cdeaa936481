"""Patterns rewritten around an xgrammar (0.2.9) regex bug, into the same language.

xgrammar compiles an optional group that ends in a repeat, `(ba+)?`, as if the repeat could also follow without the
group: `^aa(ba+)?$` accepts `aaa`, and citation-file-format's DOI pattern `^10\\.\\d{4,9}(\\.\\d+)?/...` accepts
`10.000000000000100000000000011/...` (any number of digits), so a steered reply came out invalid. The same group
written with a count, `(ba+){0,1}`, is compiled right. `optional_groups_as_counts` rewrites every `)?` (outside
classes and escapes) that way; `)??` becomes `){0,1}?`.
"""

from __future__ import annotations

from edgellm.structured.schema_strings import pattern_marks


def optional_groups_as_counts(pattern: str) -> str:
    """`pattern` with every group quantified by `?` quantified by `{0,1}` instead (the same regular language)."""
    marks = pattern_marks(pattern)
    if marks is None:
        return pattern  # an unterminated class: xgrammar reports it when it compiles the pattern
    cuts = [i + 1 for i, c, _ in marks if c == ")" and pattern.startswith("?", i + 1)]
    out, last = [], 0
    for cut in cuts:
        out.append(pattern[last:cut] + "{0,1}")
        last = cut + 1
    return "".join(out) + pattern[last:]
