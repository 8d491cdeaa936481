"""Compile a ResponseFormat into an xgrammar grammar, cached per tokenizer and per schema/grammar/regex: in memory,
and on disk (xgrammar's own JSON serialization, never pickle) so a later process skips the compile. xgrammar is
reached through its C++ core (structured/xgrammar_core.py), never its Python package (which imports torch)."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgellm.errors import GrammarError, SchemaError
from edgellm.paths import edgellm_home
from edgellm.structured.checked_file import SUFFIX, discard, read_checked, trim_folder, write_checked
from edgellm.structured.pattern_bound import check_grammar_format, check_pattern, check_regex_format
from edgellm.response_format import ResponseFormat
from edgellm.structured.loop_guard.string_close import schema_patterns
from edgellm.structured.vocab_cache import VocabFiles, tokenizer_digest, vocab_cache_dir
from edgellm.structured.xgrammar_core import CompiledGrammar, Compiler, TokenizerInfo, core

if TYPE_CHECKING:
    from edgellm.tokenizer import Tokenizer

# Compiled grammars kept per tokenizer (a JSON-schema grammar for a 49k vocabulary is a few MB at most).
CACHE_CAPACITY = 64
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "; users need only the reason.
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")
DISK_FORMAT = 2  # the layout of a grammar cache file (see DiskCache)
# Grammars kept on disk at most this large in memory: xgrammar's JSON is ~50x its in-memory size (a 300-property
# object: 2.3 MiB in memory, 123 MiB and 6 s to serialize); json_object's is 21 KiB, a 30-property object's 257 KiB.
MAX_DISK_GRAMMAR_BYTES = 128 << 10
MAX_DISK_ENTRIES = 256  # files kept; past it the least recently written go (a server's clients choose schemas)


def grammar_cache_dir() -> Path:
    """Compiled grammars kept between processes: ``<home>/grammars``."""
    return edgellm_home() / "grammars"


@functools.lru_cache(maxsize=1)
def _rewrites_digest() -> str:
    """sha256 of the structured package's sources: a schema compiles to what this code's rewrites make of it, so
    a grammar cached by another version of them is never used."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


class DiskCache:
    """Compiled grammars as files named by the hash of what they were compiled from (xgrammar's version and
    serialization format, the tokenizer, the format's cache key). A file (structured/checked_file.py) holds the
    serialized grammar with the unenforced keywords, patterns and narrowings under one SHA-256; one that fails any
    check is ignored, removed and recompiled."""

    def __init__(self, folder: Path, tokenizer_digest: str) -> None:
        self.folder = folder
        versions = f"{core().version}/{core().serialization_version}"
        self._salt = f"{DISK_FORMAT}/{versions}/{_rewrites_digest()}/{tokenizer_digest}"
        self.rejected = 0  # files refused since this cache was made (corrupt, truncated, mismatched)

    def path(self, key: tuple[Any, ...]) -> Path:
        digest = hashlib.sha256(f"{self._salt}/{json.dumps(key, sort_keys=True, default=repr)}".encode()).hexdigest()
        return self.folder / f"{digest}{SUFFIX}"

    def _header(self, path: Path) -> dict[str, str | int]:
        return {"format": DISK_FORMAT, "key": path.stem}

    def load(self, key: tuple[Any, ...], info: TokenizerInfo) -> CompiledFormat | None:
        """The entry for `key`, None when there is none or it fails a check (then it is removed)."""
        path = self.path(key)
        try:
            payload = read_checked(path, self._header(path))
            if payload is None:
                return None
            entry = json.loads(payload)
            lists = [entry[name] for name in ("unenforced", "patterns", "narrowed")]
            if not isinstance(entry["grammar"], str) or not all(
                    isinstance(items, list) and all(isinstance(x, str) for x in items) for items in lists):
                raise ValueError("mismatched")
            grammar = core().deserialize_compiled(entry["grammar"], info)
        except Exception:  # noqa: BLE001 - any damage to a cache file means: compile again
            self.rejected += 1
            discard(path)
            return None
        return CompiledFormat(grammar, *(tuple(items) for items in lists))

    def store(self, key: tuple[Any, ...], compiled: CompiledFormat) -> None:
        """Write the entry atomically; a failure to write is not an error, and a grammar too large to be worth
        reading back (MAX_DISK_GRAMMAR_BYTES) is not written."""
        if compiled.grammar.memory_size_bytes() > MAX_DISK_GRAMMAR_BYTES:
            return
        payload = json.dumps({"grammar": compiled.grammar.serialize_json(), "unenforced": list(compiled.unenforced),
                              "patterns": list(compiled.patterns), "narrowed": list(compiled.narrowed)})
        path = self.path(key)
        if write_checked(path, self._header(path), payload):
            trim_folder(self.folder, MAX_DISK_ENTRIES, (f"*{SUFFIX}", "*.json"))  # .json: DISK_FORMAT 1's, unread


@dataclass(frozen=True)
class CompiledFormat:
    """A grammar ready for a matcher, and the schema keywords it does not enforce (best-effort mode)."""

    grammar: CompiledGrammar
    unenforced: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()  # the schema's string patterns (the loop guard closes strings under them)
    narrowed: tuple[str, ...] = ()  # "keyword at /pointer": where the grammar accepts less than the schema


class GrammarCache:
    """One xgrammar compiler for one tokenizer, with an LRU of compiled grammars and hit/miss counters."""

    def __init__(self, info: TokenizerInfo, *, threads: int = 2, capacity: int = CACHE_CAPACITY,
                 disk: DiskCache | None = None) -> None:
        self.info = info
        self.disk = disk
        # xgrammar's own cache is off: this LRU is the one cache, so hits/misses are exact.
        self._compiler = core().compiler(info, threads)
        self._entries: OrderedDict[tuple[Any, ...], CompiledFormat] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.disk_hits = 0
        self.last_compile_s = 0.0

    def get(self, key: tuple[Any, ...], build: Callable[[Compiler], CompiledFormat]) -> CompiledFormat:
        """The cached grammar for `key`, compiled with `build` on a miss."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit
        t0 = time.perf_counter()
        compiled = self.disk.load(key, self.info) if self.disk is not None else None
        if compiled is not None:
            self.disk_hits += 1
        else:
            compiled = build(self._compiler)
            if self.disk is not None:
                self.disk.store(key, compiled)
        self.last_compile_s = time.perf_counter() - t0
        with self._lock:
            self.misses += 1
            self._entries[key] = compiled
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return compiled

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_caches: weakref.WeakKeyDictionary[Tokenizer, dict[int, GrammarCache]] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> TokenizerInfo:
    """xgrammar's view of `tokenizer`, with the mask sized to the model's logits (padding ids are never allowed)."""
    return _tokenizer_info(tokenizer, vocab_size, stop_token_ids)[0]


def _tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> tuple[TokenizerInfo, str]:
    """The TokenizerInfo, from the per-tokenizer files when they hold it (structured/vocab_cache.py), and the
    tokenizer digest (of all it is made from: the tokenizer's JSON, the size, the stops)."""
    stops = sorted(stop_token_ids)
    digest = tokenizer_digest(tokenizer, vocab_size, stops)
    files = VocabFiles(vocab_cache_dir())
    return files.tokenizer_info(digest, vocab_size, stops, lambda: _build_info(tokenizer, vocab_size, stops)), digest


def _build_info(tokenizer: Tokenizer, vocab_size: int, stops: list[int]) -> TokenizerInfo:
    """xgrammar's view of `tokenizer` built from its whole vocabulary and decoder."""
    backend = tokenizer._backend  # the `tokenizers.Tokenizer` under the wrapper
    encoded = [""] * vocab_size  # empty entries (padding beyond the tokenizer) count as special: always masked
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            encoded[index] = token
    if backend.decoder is not None:  # byte-level / byte-fallback / metaspace vocabularies, read from the decoder
        vocab_type, prefix_space = core().detect_metadata(backend.to_str())
    else:  # no decoder: tokens are their own text (xgrammar would guess the same, with a warning on stderr)
        vocab_type, prefix_space = "RAW", False
    return core().tokenizer_info(encoded, vocab_type, vocab_size, stops, prefix_space)


def grammar_cache(tokenizer: Tokenizer, vocab_size: int, *, threads: int = 2) -> GrammarCache:
    """The grammar cache of `tokenizer` for a model with `vocab_size` logits (built once, then shared)."""
    with _caches_lock:
        per_tokenizer = _caches.setdefault(tokenizer, {})
        cache = per_tokenizer.get(vocab_size)
        if cache is None:
            info, digest = _tokenizer_info(tokenizer, vocab_size, tokenizer.stop_token_ids)
            cache = per_tokenizer[vocab_size] = GrammarCache(info, threads=threads,
                                                             disk=DiskCache(grammar_cache_dir(), digest))
        return cache


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGR_PREFIX.sub("", text)


def _json_options(rf: ResponseFormat) -> dict[str, Any]:
    """Whitespace options: compact separators by default, or at most `max_whitespace` characters per gap."""
    if rf.max_whitespace == 0:
        return {"any_whitespace": False}
    if rf.max_whitespace is not None and rf.max_whitespace < 0:
        raise SchemaError(f"max_whitespace must be None or >= 0, got {rf.max_whitespace}")
    return {"any_whitespace": True, "max_whitespace_cnt": rf.max_whitespace}


def _compile_json(compiler: Compiler, schema: str, strict: bool, options: dict[str, Any]) -> CompiledGrammar:
    """`schema` compiled on one line with compact separators (`options`: from _json_options)."""
    return compiler.compile_json_schema(schema, options["any_whitespace"], None, None, strict,
                                        options.get("max_whitespace_cnt"), False)


def compile_format(cache: GrammarCache, rf: ResponseFormat) -> CompiledFormat | None:
    """Compile `rf` (None for plain text). Raises SchemaError/GrammarError for anything malformed or unsupported."""
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        options = _json_options(rf)
        key: tuple[Any, ...] = ("json_object", tuple(sorted(options.items())))
        return cache.get(key, lambda c: CompiledFormat(_compile_json(c, '{"type": "object"}', False, options)))
    if rf.type == "json_schema":
        if not isinstance(rf.schema, dict):
            raise SchemaError("json_schema needs a schema object (a JSON object), got "
                              f"{type(rf.schema).__name__}")
        options = _json_options(rf)
        try:
            text = json.dumps(rf.schema, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise SchemaError(f"schema is not JSON-serializable: {e}") from None
        key = ("json_schema", text, rf.strict, rf.best_effort, tuple(sorted(options.items())))

        def build(compiler: Compiler) -> CompiledFormat:
            # Checked on a miss only: a refused schema raises here and is never cached. Imported here: jsonschema's
            # import is a large part of a json_object request's start, which needs none of it.
            from edgellm.structured.schema_support import prepare

            ready = prepare(rf.schema, best_effort=rf.best_effort, strict=rf.strict)
            prepared = ready.schema
            patterns = schema_patterns(prepared)
            for pattern in patterns:
                check_pattern(pattern, what="schema pattern", syntax=False)
            body = json.dumps(prepared, ensure_ascii=False)
            try:
                grammar = _compile_json(compiler, body, rf.strict, options)
            except Exception as e:  # xgrammar raises RuntimeError/ValueError with its converter's message
                raise SchemaError(f"invalid JSON schema: {_reason(e)}") from None
            return CompiledFormat(grammar, ready.unenforced, patterns, tuple(str(n) for n in ready.narrowed))

        return cache.get(key, build)
    if rf.type == "grammar":
        ebnf = check_grammar_format(rf.grammar)  # too costly to match: refused before xgrammar sees it

        def build_ebnf(compiler: Compiler) -> CompiledFormat:
            try:
                return CompiledFormat(compiler.compile_grammar_ebnf(core().grammar_from_ebnf(ebnf)))
            except Exception as e:
                raise GrammarError(f"invalid EBNF grammar: {_reason(e)}") from None

        return cache.get(("grammar", ebnf), build_ebnf)
    if rf.type == "regex":
        regex = check_regex_format(rf.regex)  # malformed or too costly to match: refused before xgrammar sees it

        def build_regex(compiler: Compiler) -> CompiledFormat:
            try:
                return CompiledFormat(compiler.compile_regex(regex))
            except Exception as e:
                raise GrammarError(f"invalid regex: {_reason(e)}") from None

        return cache.get(("regex", regex), build_regex)
    raise SchemaError(f"unknown response_format type {rf.type!r} "
                      "(expected text, json_object, json_schema, grammar or regex)")
