"""Text <-> token ids: a thin wrapper over `tokenizers.Tokenizer`, and incremental detokenization for streaming."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers

from edgellm.errors import ArtifactError

_REPLACEMENT = "\ufffd"
# Pending tokens that still end in an incomplete character after this many are emitted anyway: the output is not
# valid UTF-8, and holding it longer would make each step re-decode an ever longer window.
_MAX_PENDING = 64


class Tokenizer:
    """A model's tokenizer: encodes with special tokens recognized in the text, BOS handled here (not by the
    tokenizer's post-processor), decodes with special tokens kept."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        add_bos_token: bool = False,
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.file_sha256: str | None = None  # sha256 of the tokenizer.json it was loaded from (from_file)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        stops = set(stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        for name, token_id in [("bos_token_id", bos_token_id), *(("stop token id", i) for i in stops)]:
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ArtifactError(f"tokenizer {name} {token_id} is outside the vocabulary ({self.vocab_size})")

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        add_bos_token: bool = False,
        stop_token_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """Load a `tokenizer.json`."""
        try:
            data = Path(path).read_bytes()
            backend = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the Rust side raises plain Exception with a multi-line message
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ArtifactError(f"cannot load tokenizer {path}: {reason}") from None
        tokenizer = cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            add_bos_token=add_bos_token,
            stop_token_ids=stop_token_ids,
        )
        tokenizer.file_sha256 = hashlib.sha256(data).hexdigest()  # keys per-tokenizer caches (cheaper than to_str)
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str:
        """The BOS token's text ("" when there is none), as chat templates expect it."""
        return "" if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        """The EOS token's text ("" when there is none)."""
        return "" if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; BOS is prepended when `add_bos` (default: the model's setting) and not already there."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included; invalid UTF-8 becomes U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry for `token_id` (byte-level tokens in their mapped form, e.g. "Ġ" for a space)."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        return token


class StreamingDetokenizer:
    """Turns generated token ids into text pieces as they arrive, never splitting a UTF-8 character.

    Keeps a short window: the last emitted tokens (as decoding context, so e.g. a leading-space marker decodes the
    same as in the full text) followed by the tokens not emitted yet. Each step decodes only that window, and the
    pieces plus `flush()` concatenate to `decode(all ids)` for any decoder where decoding is prefix-stable
    (byte-level BPE) and the output is valid UTF-8.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = tokenizer.decode
        self._ids: list[int] = []  # window: context tokens, then pending tokens
        self._read = 0  # where the pending tokens start in the window
        self._context_chars = 0  # len(decode(context tokens))

    def add(self, token_id: int) -> str:
        """Append one token; return the new text that is now complete ("" while a character is still partial)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(self._ids) - self._read > _MAX_PENDING:
            return self._emit(text, keep_context=False)
        if text.endswith(_REPLACEMENT) or len(text) <= self._context_chars:
            return ""
        return self._emit(text, keep_context=True)

    def flush(self) -> str:
        """Return whatever is pending and start over. The output ends here (a stop, or a cut at max_tokens), so a
        character whose bytes are incomplete is dropped, never rendered as U+FFFD."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids), keep_context=False).rstrip(_REPLACEMENT)

    def _emit(self, text: str, *, keep_context: bool) -> str:
        piece = text[self._context_chars :]
        self._ids = self._ids[self._read :] if keep_context else []
        self._read = len(self._ids)
        self._context_chars = len(self._decode(self._ids)) if self._ids else 0
        return piece
