"""Loop guard, copies of a loop: a value or member that starts copying text the guard already had to steer.

Once the guard has steered a value out of a loop, a small model tends to copy the looping text into the values
that follow (dependabot: `"directories": ["v2.1.1.v2.1.1.v2.1.1.1.v2.v2.v2.v"]`, then `"name"`,
`"package-ecosystem"`, … the same), or to start the next item of the enclosing array as a copy of the one whose loop
was just closed (k8s-endpoints' `subsets`). Neither repeats in place, so the other rules do not see it, and each copy
costs as many tokens as the loop did. This rule remembers what the guard steered:

- the text of every string value whose loop it penalized or closed: a string whose text (at least `min_chars`
  characters) is the start of one of them relapses, and is closed at once (the guard's closing step);
- where in the reply it acted: a member of an array or object whose text (at least `min_chars` characters, leading
  whitespace aside) is the start of an earlier member of the same container that holds such a place relapses; the
  container, and every container inside that member, are then closed at the member's next end (the
  repeated-members rule's steering).

Nothing is remembered before the guard first acts, so output that does not loop is never touched.
"""

from __future__ import annotations

import bisect
from edgellm.structured.loop_guard.scanner import JSONScanner


class Relapses:
    """What the guard steered so far, and which open values/members copy it (see the module's docstring)."""

    def __init__(self, min_chars: int) -> None:
        self.min_chars = min_chars
        self._strings: dict[int, str] = {}  # start of a string value the guard steered -> its longest text seen
        self._marks: list[int] = []  # offsets in the reply where the guard acted (ascending)
        self._members: set[int] = set()  # starts of members found copying (they relapse until they end)

    def note(self, offset: int, string_start: int | None = None, text: str = "") -> None:
        """The guard acted at `offset` of the reply; inside the string value starting at `string_start` (its text
        so far `text`), if any."""
        if not self._marks or offset > self._marks[-1]:
            self._marks.append(offset)
        if string_start is not None and len(text) > len(self._strings.get(string_start, "")):
            self._strings[string_start] = text

    def string_copy(self, scanner: JSONScanner) -> bool:
        """Is the open string value the start of a string the guard steered (a copy of at least `min_chars`)?
        Then the members of the open containers that hold the copy but not the string copied relapse too."""
        if not self._strings or scanner.value_kind != "string":
            return False
        start = scanner.value_start
        if len(scanner.text) - start < self.min_chars:
            return False
        text = scanner.text[start:]
        source = next((other for other, steered in self._strings.items()
                       if other != start and steered.startswith(text)), None)
        if source is None:
            return False
        for depth, (_, opened) in enumerate(scanner.stack, 1):
            if opened <= source < scanner.member_start(depth):
                self._members.add(scanner.member_start(depth))
        return True

    def member_copy(self, scanner: JSONScanner, depth: int) -> bool:
        """Is the current member of the open container `depth` levels deep (1: outermost) the start of an earlier
        member of it where the guard acted?"""
        if not self._marks:
            return False
        begin = scanner.member_start(depth)
        if begin in self._members:
            return True
        current = scanner.text[begin:].lstrip()
        if len(current) < self.min_chars:
            return False
        for a, b in scanner.members[depth - 1]:
            first = bisect.bisect_left(self._marks, a)
            if first < len(self._marks) and self._marks[first] < b and scanner.text[a:b].lstrip().startswith(current):
                self._members.add(begin)
                return True
        return False
