"""What a constrained request needs of a tokenizer, kept on disk beside the grammars so that a later process skips
building it (issue 28's fast start): xgrammar's TokenizerInfo in its own JSON serialization (built from the whole
vocabulary and the decoder type read from the tokenizer's JSON), and the loop guard's token texts (every token
decoded once). Files are keyed by the tokenizer digest and checked (structured/checked_file.py): a damaged, stale or
mismatched file is removed and rebuilt, never trusted."""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import tokenizers

from edgellm.paths import edgellm_home
from edgellm.structured.checked_file import SUFFIX, RefusedFile, discard, read_checked, trim_folder, write_checked

if TYPE_CHECKING:
    from edgellm.structured.xgrammar_core import TokenizerInfo
    from edgellm.tokenizer import Tokenizer

VOCAB_FORMAT = 1  # the layout of these files and the way their content is built
MAX_VOCAB_FILES = 32  # files kept (two per tokenizer and model size); past it the least recently written go

T = TypeVar("T")

_spec_digests: weakref.WeakKeyDictionary[Tokenizer, str] = weakref.WeakKeyDictionary()
_spec_lock = threading.Lock()


def vocab_cache_dir() -> Path:
    """Per-tokenizer files: ``<home>/grammars/tokenizers``."""
    return edgellm_home() / "grammars" / "tokenizers"


def spec_digest(tokenizer: Tokenizer) -> str:
    """A digest of the tokenizer's whole definition: the sha256 of the file it was loaded from, else of its JSON spec
    (computed once per tokenizer object)."""
    if tokenizer.file_sha256 is not None:
        return f"file:{tokenizer.file_sha256}"
    with _spec_lock:
        digest = _spec_digests.get(tokenizer)
        if digest is None:
            digest = _spec_digests[tokenizer] = hashlib.sha256(tokenizer._backend.to_str().encode()).hexdigest()
        return digest


def tokenizer_digest(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> str:
    """The digest xgrammar's view of `tokenizer` and every grammar compiled for it are keyed by: the tokenizer's
    spec, the model's logit count and the stop tokens."""
    return hashlib.sha256(f"{vocab_size}/{sorted(stop_token_ids)}/{spec_digest(tokenizer)}".encode()).hexdigest()


class VocabFiles:
    """The per-tokenizer files in `folder`; `loaded` and `rejected` count files read back and files refused."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.loaded = 0
        self.rejected = 0

    def tokenizer_info(self, digest: str, vocab_size: int, stop_token_ids: Iterable[int],
                       build: Callable[[], TokenizerInfo]) -> TokenizerInfo:
        """The TokenizerInfo stored under `digest` (tokenizer_digest), else `build()`'s, then stored."""
        from edgellm.structured.xgrammar_core import core

        stops = sorted(stop_token_ids)

        def load(payload: str) -> TokenizerInfo:
            info = core().deserialize_tokenizer_info(payload)
            if info.vocab_size() != vocab_size or sorted(info.stop_token_ids()) != stops:
                raise ValueError("made for another vocabulary")
            return info

        header: dict[str, str | int] = {"kind": "tokenizer-info", "key": digest,
                                        "versions": f"{core().version}/{core().serialization_version}"}
        return self._cached(header, build, lambda info: info.serialize_json(), load)

    def token_texts(self, tokenizer: Tokenizer, count: int, build: Callable[[], list[str]]) -> list[str]:
        """The texts of tokens 0..count-1 of `tokenizer` as stored, else `build()`'s, then stored."""

        def load(payload: str) -> list[str]:
            texts = json.loads(payload)
            if not isinstance(texts, list) or len(texts) != count or not set(map(type, texts)) <= {str}:
                raise ValueError("not this vocabulary's texts")
            return texts

        key = hashlib.sha256(f"{count}/{spec_digest(tokenizer)}".encode()).hexdigest()
        header: dict[str, str | int] = {"kind": "token-texts", "key": key, "versions": tokenizers.__version__}
        return self._cached(header, build, json.dumps, load)

    def _cached(self, header: dict[str, str | int], build: Callable[[], T], dump: Callable[[T], str],
                load: Callable[[str], T]) -> T:
        path = self.folder / f"{header['kind']}-{header['key']}{SUFFIX}"
        header = {"format": VOCAB_FORMAT, **header}
        try:
            payload = read_checked(path, header)
            if payload is not None:
                value = load(payload)
                self.loaded += 1
                return value
        except RefusedFile:
            self.rejected += 1
        except Exception:  # noqa: BLE001 - a payload that passed its hash but does not fit: rebuild it
            self.rejected += 1
            discard(path)
        value = build()
        if write_checked(path, header, dump(value)):
            trim_folder(self.folder, MAX_VOCAB_FILES)
        return value
