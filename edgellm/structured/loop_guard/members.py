"""Loop guard, repeated members: an array whose items (or an object whose members) keep coming back with small
variations is ended with the closing tokens the grammar allows.

Small models under a grammar often write the same array item over and over, each copy a little different
(`"mountOptions1", "mountOptions2", …`, `{"name": "serviceaccountv7", …}`, `managedFields` entries whose timestamps
differ), or the same key of a map again and again. No period repeats exactly, so the text-period rule of the loop
guard does not see it. Here every finished member of an open array or object is compared by a *signature*: its
text with digit runs masked (`#`) and, for array items, the keys of object items dropped (items of one array share
their keys by schema; their values tell whether they repeat). A member nearly repeats one of the `LOOKBACK` members
before it when their values, in order, are equal or similar one by one (difflib's ratio >= `member_similarity`;
object members must also have the same key), or repeats exactly any earlier member (a long cycle).

A container is *repeating* once it has `member_repeats` near repeats, or near repeats totalling `member_chars`
characters of signature, its current member counted; a container inside a member that copies the member before it
over `member_chars` characters is treated alike, and so are a container whose current member copies what the guard
steered (`copies.Relapses`) and every container inside that member. Only at the step where the model itself
wants to end the current member of such a container (its best allowed token finishes it, or goes on with a comma),
the tokens that close the container gain `penalty * base**k` (k: steps steered in that container) and the tokens
that go on with a comma lose as much; where the grammar does not allow closing yet (`minItems`, a required key still
missing) but ending the member is allowed, the member is ended first so that the next step can close. Members that
hold no string (numbers, booleans, null) are never compared: a vector of zeros is not a loop. Before a threshold is
reached the logits are not read, let alone changed; only finite logits (tokens the grammar allows) are ever changed.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
import numpy as np

from edgellm.loop_guard_config import LoopGuardConfig
from edgellm.structured.loop_guard.copies import Relapses
from edgellm.structured.loop_guard.scanner import JSONScanner, TokenTexts, mask_digits

_KEY = re.compile(r'"(?:[^"\\]|\\.)*"\s*:\s*')
_LEAF = re.compile(r'"(?:[^"\\]|\\.)*"?|[^\s,:{}\[\]"]+')

COMMIT, CLOSE, END = "commit", "close", "end"  # what a token does to a container's current member (None: nothing)


def member_signature(text: str, in_array: bool) -> str | None:
    """What a member is compared by (None for a member that holds no string)."""
    text = text.strip()
    if '"' not in text:
        return None
    if in_array:
        text = _KEY.sub("", text)
    return mask_digits(text)


def _split_key(signature: str) -> tuple[str, str]:
    found = _KEY.match(signature)
    return (found.group(0), signature[found.end():]) if found else ("", signature)


def _leaves(signature: str) -> list[str]:
    """The strings (unquoted; the last may be unfinished) and bare scalars of a signature, in order."""
    return [leaf.strip('"') for leaf in _LEAF.findall(signature)]


def near_repeat(a: str, b: str, in_array: bool, similarity: float) -> bool:
    """Do two member signatures nearly repeat each other? Their values, in order, must be equal or similar one by
    one (difflib's ratio >= `similarity`), so two records that share a value but differ in another do not count;
    object members must have the same key."""
    if not in_array:
        (key_a, a), (key_b, b) = _split_key(a), _split_key(b)
        if key_a != key_b:
            return False
    if a == b:
        return True
    leaves_a, leaves_b = _leaves(a), _leaves(b)
    return bool(leaves_a) and len(leaves_a) == len(leaves_b) and all(
        x == y or _similar(x, y, similarity) for x, y in zip(leaves_a, leaves_b))


def _similar(a: str, b: str, similarity: float) -> bool:
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return matcher.real_quick_ratio() >= similarity and matcher.quick_ratio() >= similarity \
        and matcher.ratio() >= similarity


def effect(scanner: JSONScanner, piece: str, depth: int) -> str | None:
    """What appending `piece` does to the current member of the container `depth` levels deep (stack length):
    CLOSE (the container is closed), COMMIT (a comma starts its next member), END (the member is finished and
    nothing follows yet), or None."""
    d, in_string = len(scanner.stack), scanner.in_string
    inside = d > depth or in_string  # the piece starts inside the current member
    for ch, d, in_string in scanner.walk(piece):
        if in_string:
            continue
        if ch in "}]" and d < depth:
            return CLOSE
        if ch == "," and d == depth:
            return COMMIT
    return END if inside and d == depth and not in_string else None


def best_token(logits: np.ndarray) -> int:
    """The argmax of 1-D logits."""
    return int(np.argmax(logits))


@dataclass
class _Counts:
    seen: int = 0  # finished members already compared
    repeats: int = 0  # of them, those that nearly repeat one of the few before
    chars: int = 0  # the length of their signatures
    longest: int = 0  # the longest signature so far
    steered: int = 0  # steps this rule changed while ending a member of this container
    recent: list[str] = field(default_factory=list)
    earlier: set[str] = field(default_factory=set)  # every signature so far (a long cycle repeats them exactly)
    keys: set[str] = field(default_factory=set)  # object members: every key so far (digits masked)


def _key(text: str) -> str | None:
    """The key (digits masked) an object member's text starts with; None while it is not written yet."""
    found = _KEY.match(text.lstrip())
    return mask_digits(found.group(0)) if found else None


class RepeatedMembers:
    """Closes open arrays/objects whose members keep nearly repeating (see the module's docstring)."""

    LOOKBACK = 3  # a member is compared with this many members before it (catches A A B B A A … too)

    def __init__(self, table: TokenTexts, cfg: LoopGuardConfig, relapses: Relapses) -> None:
        self.cfg = cfg
        self._table = table
        self._relapses = relapses  # members copying one the guard steered are closed too (copies.py)
        self._counts: dict[int, _Counts] = {}  # by the container's start offset
        self.steps = 0  # steps whose logits this rule changed

    def _repeats(self, counts: _Counts, sig: str | None, in_array: bool) -> tuple[int, int]:
        """(repeats, chars) of a container if its member signed `sig` nearly repeats one of the recent ones."""
        if sig is not None and (sig in counts.earlier or any(
                near_repeat(sig, prev, in_array, self.cfg.member_similarity) for prev in counts.recent)):
            return counts.repeats + 1, counts.chars + len(sig)
        return counts.repeats, counts.chars

    def _update(self, scanner: JSONScanner) -> None:
        """Compare the members finished since the last step with those before them."""
        if len(self._counts) > len(scanner.stack):  # forget closed containers
            open_starts = {start for _, start in scanner.stack}
            self._counts = {k: v for k, v in self._counts.items() if k in open_starts}
        for (bracket, start), spans in zip(scanner.stack, scanner.members):
            counts = self._counts.get(start)
            if counts is None:
                counts = self._counts[start] = _Counts()
            if counts.seen == len(spans):
                continue
            in_array = bracket == "["
            for a, b in spans[counts.seen:]:
                sig = member_signature(scanner.text[a:b], in_array)
                counts.repeats, counts.chars = self._repeats(counts, sig, in_array)
                if sig is not None:
                    counts.recent = (counts.recent + [sig])[-self.LOOKBACK:]
                    counts.earlier.add(sig)
                    counts.longest = max(counts.longest, len(sig))
                    if not in_array and (key := _key(sig)) is not None:
                        counts.keys.add(key)
            counts.seen = len(spans)

    def _repeating(self, scanner: JSONScanner, depth: int) -> bool:
        """Does the container `depth` levels deep reach a threshold, its current member counted?"""
        bracket, start = scanner.stack[depth - 1]
        counts, in_array = self._counts[start], bracket == "["
        # cheap bounds first (this runs every step): a near repeat has a recent member's key and at most about
        # twice the longest signature's length
        if not counts.recent or counts.repeats + 1 < self.cfg.member_repeats \
                and counts.chars + 2 * counts.longest < self.cfg.member_chars:
            return False
        begin = scanner.member_start(depth)
        if not in_array and _key(scanner.text[begin:begin + 256]) not in counts.keys:
            return False
        sig = member_signature(scanner.text[begin:], in_array)
        repeats, chars = self._repeats(counts, sig, in_array)  # the member being ended counts too
        return repeats >= self.cfg.member_repeats or chars >= self.cfg.member_chars

    def _copying(self, scanner: JSONScanner, depth: int) -> bool:
        """Is the unfinished member of the container `depth` levels deep copying the member before it (over at
        least `member_chars` characters of signature)?"""
        bracket, start = scanner.stack[depth - 1]
        counts, begin = self._counts[start], scanner.member_start(depth)
        if not counts.recent or len(counts.recent[-1]) < self.cfg.member_chars \
                or len(scanner.text) - begin < self.cfg.member_chars:
            return False
        current = member_signature(scanner.text[begin:], bracket == "[")
        if current is None or len(current) < self.cfg.member_chars:
            return False
        return near_repeat(current, counts.recent[-1][:len(current)], True, self.cfg.member_similarity)

    def _armed(self, scanner: JSONScanner) -> list[int]:
        """Depths (innermost first) of the open containers that repeat, whose current member copies one the guard
        steered, or that lie inside a member that copies the one before it: where ending the current member is
        steered to closing the container."""
        armed, copying = [], False
        for depth in range(1, len(scanner.stack) + 1):
            relapse = self._relapses.member_copy(scanner, depth)
            if copying or relapse or self._repeating(scanner, depth):
                armed.append(depth)
            copying = copying or relapse or self._copying(scanner, depth)
        return armed[::-1]

    def steer(self, scanner: JSONScanner, logits: np.ndarray) -> np.ndarray | None:
        """A changed copy of `logits` when a repeating container's member is about to end; None otherwise."""
        self._update(scanner)
        armed = self._armed(scanner)
        if not armed:
            return None  # the logits are not even read
        top = self._table.text(best_token(logits))
        depth, wanted = next(((d, e) for d in armed if (e := effect(scanner, top, d)) in (COMMIT, END)), (0, None))
        if wanted is None:
            return None
        counts = self._counts[scanner.stack[depth - 1][1]]
        structural = self._table.structural[self._table.structural < logits.shape[-1]]
        ids = structural[np.isfinite(logits[structural])].tolist()
        by_effect: dict[str | None, list[int]] = {COMMIT: [], CLOSE: [], END: [], None: []}
        for i in ids:
            by_effect[effect(scanner, self._table.text(i), depth)].append(i)
        lift = by_effect[CLOSE] or (by_effect[END] if wanted == COMMIT else [])
        if not lift:
            return None  # the grammar does not let this container close (nor its member end) here
        counts.steered += 1
        amount = self.cfg.penalty * self.cfg.base ** min(counts.steered, 60)
        logits = logits.copy()  # the caller's logits are never changed in place
        logits[np.array(lift)] += amount
        if by_effect[COMMIT]:
            logits[np.array(by_effect[COMMIT])] -= amount
        self.steps += 1
        self._relapses.note(len(scanner.text))
        return logits
