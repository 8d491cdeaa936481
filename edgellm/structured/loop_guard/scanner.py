"""The loop guard's view of the reply: the JSON being written (`JSONScanner`) and the vocabulary's token texts
(`TokenTexts`). A leaf: the guard's rules, the budget finish and the string closer read these and nothing else of
the request."""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from edgellm.tokenizer import Tokenizer

_DIGITS = re.compile(r"\d+")
_STRUCTURAL = re.compile(r'["}\],]')  # a character that can end a member or close a container


class JSONScanner:
    """Follows generated JSON text character by character: open containers, and where the innermost open string or
    number (and the innermost array) started."""

    def __init__(self) -> None:
        self.text = ""
        self.stack: list[tuple[str, int]] = []  # ("{" | "[", offset just past the bracket)
        self.members: list[list[tuple[int, int]]] = []  # per open container: (start, end) of its finished members
        self._member_start: list[int] = []  # per open container: where its current member starts
        self.in_string = False
        self.escape = False
        self.value_kind: str | None = None  # "string" | "number" while one is open
        self.value_start = 0

    def feed(self, piece: str) -> None:
        start = len(self.text)
        for i, ch in enumerate(piece):
            self._char(ch, start + i)
        self.text += piece  # once per piece: the reply's text is not copied once per character

    def _char(self, ch: str, at: int) -> None:
        """Advance the state past `ch`, the text's character at offset `at`."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string, self.value_kind = False, None
            return
        if self.value_kind == "number" and not (ch.isdigit() or ch in "+-.eE"):
            self.value_kind = None
        if ch == '"':
            self.in_string, self.value_kind, self.value_start = True, "string", at + 1
        elif ch in "{[":
            self.stack.append((ch, at + 1))
            self.members.append([])
            self._member_start.append(at + 1)
        elif ch in "}]":
            if self.stack:
                self.stack.pop()
                self.members.pop()
                self._member_start.pop()
        elif ch == "," and self.stack:
            self.members[-1].append((self._member_start[-1], at))
            self._member_start[-1] = at + 1
        elif self.value_kind is None and (ch.isdigit() or ch == "-"):
            self.value_kind, self.value_start = "number", at

    def walk(self, piece: str) -> Iterator[tuple[str, int, bool]]:
        """Reads `piece` as if it followed the text, without changing the scanner: for each character, (the
        character, how many containers are open after it, whether a string is open after it)."""
        depth, in_string, escape = len(self.stack), self.in_string, self.escape
        for ch in piece:
            if in_string:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth = max(0, depth - 1)
            yield ch, depth, in_string

    def member_start(self, depth: int) -> int:
        """Where the current member of the open container `depth` levels deep (1: outermost) starts."""
        return self._member_start[depth - 1]

    def segments(self) -> list[tuple[str, str, int]]:
        """(kind, text, start) of the open value and of the innermost open array's items, innermost first."""
        out = []
        if self.value_kind is not None:
            out.append((self.value_kind, self.text[self.value_start:], self.value_start))
        arrays = [start for bracket, start in self.stack if bracket == "["]
        if arrays:
            out.append(("array", self.text[arrays[-1]:], arrays[-1]))
        return out


def mask_digits(text: str) -> str:
    """`text` with every run of digits replaced by one `#` (counting loops repeat in this view)."""
    return _DIGITS.sub("#", text)


class TokenTexts:
    """Token id → its text alone, and the ids whose text starts by closing a string / a number / an array."""

    def __init__(self, texts: list[str], special: Iterable[int]) -> None:
        """`texts[i]`: token i decoded alone (decode_texts); `special`: the tokens that are never text (the stops)."""
        self.texts = texts
        special = set(special)
        ordinary = np.ones(len(texts), dtype=bool)  # not special
        ordinary[[i for i in special if 0 <= i < len(texts)]] = False
        first = np.array([t[:1] for t in texts], dtype="<U1")  # "" for an empty text
        self.closers = {
            "string": np.flatnonzero((first == '"') & ordinary),
            "number": np.flatnonzero(((first == ",") | (first == "}") | (first == "]") | (first == " ")) & ordinary),
            "array": np.flatnonzero((first == "]") & ordinary),
        }
        # the ids that can end a member of an array/object or close it (examined by the repeated-members rule):
        # each structural character of all the texts joined, mapped back to the token it is in
        ends = np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)))
        at = np.fromiter((m.start() for m in _STRUCTURAL.finditer("".join(texts))), dtype=np.int64)
        holds = np.zeros(len(texts), dtype=bool)  # (np.unique would import numpy.ma: 80 ms of a request's start)
        holds[np.searchsorted(ends, at, side="right")] = True
        self.structural = np.flatnonzero(holds & ordinary)
        self._special = special
        self._by_text: dict[str, list[int]] | None = None

    def text(self, token: int) -> str:
        return self.texts[token] if 0 <= token < len(self.texts) else ""

    def ids_of(self, text: str) -> list[int]:
        """The ids of the (non-special) tokens whose text is `text` (the index is built on first use)."""
        if self._by_text is None:
            by_text: dict[str, list[int]] = {}
            for i, t in enumerate(self.texts):
                if t and i not in self._special:
                    by_text.setdefault(t, []).append(i)
            self._by_text = by_text  # one assignment: a concurrent request sees the whole index or builds its own
        return self._by_text.get(text, [])


_tables: weakref.WeakKeyDictionary[Tokenizer, dict[int, TokenTexts]] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def decode_texts(tokenizer: Tokenizer, count: int) -> list[str]:
    """Tokens 0..count-1 of `tokenizer`, each decoded alone (special tokens kept)."""
    backend = tokenizer._backend
    return [backend.decode([i], skip_special_tokens=False) for i in range(count)]


def token_texts(tokenizer: Tokenizer, vocab_size: int) -> TokenTexts:
    """The per-tokenizer table, built once per process from the texts kept on disk (structured/vocab_cache.py;
    decoding every token costs about a second for a 150k vocabulary)."""
    from edgellm.structured.vocab_cache import VocabFiles, vocab_cache_dir

    with _tables_lock:
        per = _tables.setdefault(tokenizer, {})
        if vocab_size not in per:
            count = min(vocab_size, tokenizer.vocab_size)
            texts = VocabFiles(vocab_cache_dir()).token_texts(tokenizer, count, lambda: decode_texts(tokenizer, count))
            per[vocab_size] = TokenTexts(texts, tokenizer.stop_token_ids)
        return per[vocab_size]
