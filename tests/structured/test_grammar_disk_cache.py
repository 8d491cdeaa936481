"""The on-disk grammar cache (issue 28's fast constrained start): a second cache finds the grammar a first one
compiled; a damaged file (bytes flipped, truncated, a swapped grammar, a foreign format) is refused, removed and
recompiled; and the grammar it gives constrains exactly as a fresh compile does."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

xgr = pytest.importorskip("xgrammar")

from edgellm.structured.grammar import DiskCache, GrammarCache, compile_format, tokenizer_info  # noqa: E402
from edgellm.response_format import ResponseFormat  # noqa: E402
from edgellm.structured.xgrammar_core import core  # noqa: E402
from tests.support.cache_files import change_header, change_payload  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "pattern": "^x+$"}},
          "required": ["a", "b"]}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.support.tiny_chat import tiny_chat_engine

    return tiny_chat_engine(tmp_path_factory.mktemp("tiny"))


def _cache(engine: Any, folder: Path) -> GrammarCache:
    info = tokenizer_info(engine.tokenizer, engine.config.model.vocab_size, engine.tokenizer.stop_token_ids)
    digest = hashlib.sha256(info.serialize_json().encode()).hexdigest()
    return GrammarCache(info, threads=1, disk=DiskCache(folder, digest))


def _accepts(compiled: Any, engine: Any, text: str) -> bool:
    matcher = core().matcher(compiled.grammar)
    return all(matcher.accept_token(t) for t in engine.tokenizer.encode(text)) and matcher.is_completed()


def test_a_second_process_cache_loads_what_the_first_compiled(engine: Any, tmp_path: Path) -> None:
    fmt = ResponseFormat("json_schema", schema=SCHEMA)
    first = _cache(engine, tmp_path)
    compiled = compile_format(first, fmt)
    assert (first.disk_hits, len(list(tmp_path.glob("*.cache")))) == (0, 1)
    second = _cache(engine, tmp_path)
    loaded = compile_format(second, fmt)
    assert second.disk_hits == 1 and loaded is not None and compiled is not None
    assert loaded.patterns == compiled.patterns == ("^x+$",)
    for text in ('{"a": 1, "b": "xx"}', '{"a": 1, "b": "xy"}', '{"a": "1", "b": "x"}'):
        assert _accepts(loaded, engine, text) == _accepts(compiled, engine, text)
    assert _accepts(loaded, engine, '{"a": 1, "b": "xx"}')


def test_a_cached_grammar_keeps_its_narrowings(engine: Any, tmp_path: Path) -> None:
    """What a schema was narrowed to is said again when its grammar comes from disk (never a silent narrowing)."""
    fmt = ResponseFormat("json_schema", schema={"type": "array", "items": {"type": "string"}, "uniqueItems": True})
    compiled = compile_format(_cache(engine, tmp_path), fmt)
    second = _cache(engine, tmp_path)
    loaded = compile_format(second, fmt)
    assert second.disk_hits == 1 and compiled is not None and loaded is not None
    assert compiled.narrowed and loaded.narrowed == compiled.narrowed
    assert any(n.startswith("uniqueItems at /uniqueItems") for n in loaded.narrowed), loaded.narrowed


def test_a_large_grammar_is_not_written(engine: Any, tmp_path: Path) -> None:
    """Found by the fuzz suite running out of memory: serializing a wide object's grammar took 0.9 GB and 6 s (123
    MiB of JSON for 300 properties); such a grammar stays in memory only."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    cache = _cache(engine, tmp_path)
    compiled = compile_format(cache, ResponseFormat("json_schema", schema=wide, strict=False))
    assert compiled is not None and _accepts(compiled, engine, '{"p7": "x"}')
    assert list(tmp_path.glob("*.cache")) == []
    assert compile_format(cache, ResponseFormat("json_schema", schema=SCHEMA)) is not None
    assert len(list(tmp_path.glob("*.cache"))) == 1  # a small one still is


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


def _rewrite_payload(path: Path, change: Any, rehash: bool) -> None:
    def rewrite(text: str) -> str:
        payload = json.loads(text)
        change(payload)
        return json.dumps(payload)

    change_payload(path, rewrite, rehash=rehash)


def _swap_grammar(path: Path) -> None:
    """One digit changed inside the grammar: still a grammar xgrammar reads, but not the one compiled."""
    def change(payload: dict[str, Any]) -> None:
        grammar = payload["grammar"]
        at = next(i for i in range(len(grammar) // 2, len(grammar)) if grammar[i] in "123456789")
        payload["grammar"] = grammar[:at] + str(int(grammar[at]) % 9 + 1) + grammar[at + 1:]

    _rewrite_payload(path, change, rehash=False)


def _rehashed_garbage(path: Path) -> None:
    """A grammar that passes the hash (rehashed), not xgrammar."""
    _rewrite_payload(path, lambda payload: payload.update(grammar='{"not": "a grammar"}'), rehash=True)


def _rehashed_narrowings(path: Path) -> None:
    """Narrowings that are not a list of strings, rehashed: refused rather than reported wrongly."""
    _rewrite_payload(path, lambda payload: payload.update(narrowed=[1]), rehash=True)


@pytest.mark.parametrize("damage", [
    _flip, _swap_grammar, _rehashed_garbage, _rehashed_narrowings,
    lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 3]),
    lambda p: change_header(p, "format", 99),
    lambda p: p.write_text("[]"),
], ids=["flipped", "swapped", "rehashed", "narrowings", "truncated", "format", "not-an-object"])
def test_a_damaged_cache_file_is_refused_and_recompiled(engine: Any, tmp_path: Path, damage: Any) -> None:
    fmt = ResponseFormat("regex", regex="(ab|cd){1,3}")
    compile_format(_cache(engine, tmp_path), fmt)
    (path,) = tmp_path.glob("*.cache")
    damage(path)
    cache = _cache(engine, tmp_path)
    compiled = compile_format(cache, fmt)
    assert (cache.disk_hits, cache.disk.rejected) == (0, 1)  # type: ignore[union-attr]
    assert compiled is not None and _accepts(compiled, engine, "abcd") and not _accepts(compiled, engine, "abc")
    fresh = _cache(engine, tmp_path)  # the recompiled grammar was written back, whole
    compile_format(fresh, fmt)
    assert (fresh.disk_hits, fresh.disk.rejected) == (1, 0)  # type: ignore[union-attr]
    assert not list(tmp_path.glob(".*.partial"))


def test_entries_are_per_tokenizer_and_per_format(engine: Any, tmp_path: Path) -> None:
    cache = _cache(engine, tmp_path)
    compile_format(cache, ResponseFormat("regex", regex="a+"))
    compile_format(cache, ResponseFormat("regex", regex="b+"))
    other = DiskCache(tmp_path, "another-tokenizer")
    assert other.path(("regex", "a+")) != cache.disk.path(("regex", "a+"))  # type: ignore[union-attr]
    assert len(list(tmp_path.glob("*.cache"))) == 2


def test_the_folder_keeps_at_most_its_entry_count(engine: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import edgellm.structured.grammar as grammar

    monkeypatch.setattr(grammar, "MAX_DISK_ENTRIES", 3)
    cache = _cache(engine, tmp_path)
    for n in range(5):
        compile_format(cache, ResponseFormat("regex", regex=f"a{{{n + 1}}}"))
    kept = sorted(tmp_path.glob("*.cache"))
    assert len(kept) == 3
    assert cache.disk.path(("regex", "a{5}")) in kept  # type: ignore[union-attr]  # the newest stays
