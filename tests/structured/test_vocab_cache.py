"""The per-tokenizer files beside the grammar cache (issue 28's fast constrained start): xgrammar's TokenizerInfo
and the loop guard's token texts are read back by a later process instead of rebuilt, constrain exactly as a fresh
build does, and a damaged, stale or mismatched file is refused, removed and rebuilt (never trusted)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("xgrammar")

from edgellm.response_format import ResponseFormat  # noqa: E402
from edgellm.structured import grammar, vocab_cache  # noqa: E402
from edgellm.structured.loop_guard import scanner  # noqa: E402
from edgellm.structured.vocab_cache import VocabFiles, tokenizer_digest  # noqa: E402
from edgellm.structured.xgrammar_core import core  # noqa: E402
from edgellm.tokenizer import Tokenizer  # noqa: E402
from tests.support.cache_files import change_header, change_payload  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.support.tiny_chat import tiny_chat_engine

    return tiny_chat_engine(tmp_path_factory.mktemp("tiny"))


def _fresh_tokenizer(engine: Any) -> Tokenizer:
    """The engine's tokenizer loaded again: a new object, as a later process has (nothing memoized for it)."""
    tok = engine.tokenizer
    return Tokenizer.from_file(engine.artifact.tokenizer_path, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, stop_token_ids=tok.stop_token_ids)


def _info(files: VocabFiles, engine: Any, tokenizer: Tokenizer | None = None) -> Any:
    tokenizer = tokenizer or engine.tokenizer
    vocab, stops = engine.config.model.vocab_size, sorted(tokenizer.stop_token_ids)
    return files.tokenizer_info(tokenizer_digest(tokenizer, vocab, stops), vocab, stops,
                                lambda: grammar._build_info(tokenizer, vocab, stops))


def _texts(files: VocabFiles, tokenizer: Tokenizer) -> list[str]:
    return files.token_texts(tokenizer, tokenizer.vocab_size, lambda: scanner.decode_texts(tokenizer,
                                                                                           tokenizer.vocab_size))


def _accepts(info: Any, engine: Any, text: str) -> bool:
    compiled = core().compiler(info, 1).compile_json_schema(
        json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        False, None, None, True, None, False)
    matcher = core().matcher(compiled)
    return all(matcher.accept_token(t) for t in engine.tokenizer.encode(text)) and matcher.is_completed()


def test_a_later_process_reads_the_tokenizer_info_back(engine: Any, tmp_path: Path) -> None:
    first = VocabFiles(tmp_path)
    built = _info(first, engine)
    assert (first.loaded, first.rejected, len(list(tmp_path.glob("tokenizer-info-*.cache")))) == (0, 0, 1)
    second = VocabFiles(tmp_path)
    loaded = _info(second, engine, _fresh_tokenizer(engine))
    assert (second.loaded, second.rejected) == (1, 0)
    assert loaded.serialize_json() == built.serialize_json()
    for text in ('{"a": 1}', '{"a": "1"}', '{"b": 1}', '{"a": 12}'):
        assert _accepts(loaded, engine, text) == _accepts(built, engine, text)
    assert _accepts(loaded, engine, '{"a": 12}') and not _accepts(loaded, engine, '{"a": "1"}')


def test_a_later_process_reads_the_token_texts_back(engine: Any, tmp_path: Path) -> None:
    tok = engine.tokenizer
    reference = [tok._backend.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]
    assert _texts(VocabFiles(tmp_path), tok) == reference
    second = VocabFiles(tmp_path)
    assert _texts(second, _fresh_tokenizer(engine)) == reference and second.loaded == 1


def test_requests_of_a_later_process_build_nothing(engine: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """grammar_cache and token_texts (what a constrained request asks for) use the files under EDGELLM_HOME."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    vocab = engine.config.model.vocab_size
    first = grammar.grammar_cache(_fresh_tokenizer(engine), vocab, threads=1)
    first_table = scanner.token_texts(_fresh_tokenizer(engine), vocab)
    assert len(list(vocab_cache.vocab_cache_dir().glob("*.cache"))) == 2

    def refuse(*args: object) -> Any:
        raise AssertionError("rebuilt although the files hold it")

    monkeypatch.setattr(grammar, "_build_info", refuse)
    monkeypatch.setattr(scanner, "decode_texts", refuse)
    later = _fresh_tokenizer(engine)
    cache = grammar.grammar_cache(later, vocab, threads=1)
    assert cache.info.serialize_json() == first.info.serialize_json()
    assert grammar.compile_format(cache, ResponseFormat("json_object")) is not None
    table = scanner.token_texts(later, vocab)
    assert table.texts == first_table.texts
    assert all((table.closers[k] == first_table.closers[k]).all() for k in first_table.closers)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


def _rehash(path: Path, change: Callable[[str], str]) -> None:
    change_payload(path, change, rehash=True)


def _header(name: str, value: object) -> Callable[[Path], None]:
    return lambda p: change_header(p, name, value)


def _other_vocabulary(path: Path) -> None:
    """A valid TokenizerInfo of another size, rehashed: it passes the hash and xgrammar, not the size check."""
    other = core().tokenizer_info(["a", "b"], "RAW", 2, [1], False).serialize_json()
    _rehash(path, lambda _: other)


DAMAGES = {
    "flipped": _flip,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "not-utf8": lambda p: p.write_bytes(b"\xff" + p.read_bytes()),
    "stale-version": _header("versions", "0.0.1/v0"),
    "format": _header("format", 99),
    "other-key": _header("key", "0" * 64),
    "rehashed-garbage": lambda p: _rehash(p, lambda _: '{"not": "a tokenizer"}'),
    "not-an-object": lambda p: p.write_text("[]"),
    "no-header": lambda p: p.write_bytes(p.read_bytes().partition(b"\n")[2]),
    "longer": lambda p: p.write_bytes(p.read_bytes() + b" "),
}


@pytest.mark.parametrize("damage", [*DAMAGES.values(), _other_vocabulary], ids=[*DAMAGES, "other-vocabulary"])
def test_a_damaged_tokenizer_info_is_refused_and_rebuilt(engine: Any, tmp_path: Path,
                                                         damage: Callable[[Path], None]) -> None:
    built = _info(VocabFiles(tmp_path), engine).serialize_json()
    (path,) = tmp_path.glob("tokenizer-info-*.cache")
    damage(path)
    files = VocabFiles(tmp_path)
    info = _info(files, engine)
    assert (files.loaded, files.rejected) == (0, 1)
    assert info.serialize_json() == built and _accepts(info, engine, '{"a": 1}')
    again = VocabFiles(tmp_path)  # rebuilt and written back, whole
    assert _info(again, engine).serialize_json() == built and (again.loaded, again.rejected) == (1, 0)
    assert not list(tmp_path.glob(".*.partial"))


@pytest.mark.parametrize("damage", [
    *DAMAGES.values(),
    lambda p: _rehash(p, lambda payload: json.dumps(json.loads(payload)[:-1])),  # one text short
    lambda p: _rehash(p, lambda payload: json.dumps([1] * len(json.loads(payload)))),  # not texts
], ids=[*DAMAGES, "short", "not-texts"])
def test_damaged_token_texts_are_refused_and_rebuilt(engine: Any, tmp_path: Path,
                                                     damage: Callable[[Path], None]) -> None:
    tok = engine.tokenizer
    built = _texts(VocabFiles(tmp_path), tok)
    (path,) = tmp_path.glob("token-texts-*.cache")
    damage(path)
    files = VocabFiles(tmp_path)
    assert _texts(files, tok) == built and (files.loaded, files.rejected) == (0, 1)
    again = VocabFiles(tmp_path)
    assert _texts(again, tok) == built and (again.loaded, again.rejected) == (1, 0)


def test_an_unwritable_folder_still_builds(engine: Any, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    files = VocabFiles(blocked / "tokenizers")
    assert _texts(files, engine.tokenizer) == scanner.decode_texts(engine.tokenizer, engine.tokenizer.vocab_size)
    assert _accepts(_info(files, engine), engine, '{"a": 1}')


def test_the_folder_keeps_at_most_its_file_count(engine: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vocab_cache, "MAX_VOCAB_FILES", 1)
    files = VocabFiles(tmp_path)
    _info(files, engine)
    _texts(files, engine.tokenizer)
    assert [p.name.split("-")[0] for p in tmp_path.glob("*.cache")] == ["token"]  # the newest stays


@pytest.mark.parametrize("texts", [
    ['"', "]", '"}', "", "ab", ' "x', ",", "}]", "\x00", "12", "]]", "x]", "é,", ""],
    [chr(c) for c in range(256)] + ["<s>", "</s>"],
], ids=["crafted", "bytes"])
def test_the_tables_token_classes_match_a_plain_scan(texts: list[str]) -> None:
    """The table's id sets (found with array operations over all texts at once) are what a token-by-token scan of
    the texts finds, special tokens left out."""
    special = {0, len(texts) - 1, 999}  # an id past the vocabulary is ignored
    table = scanner.TokenTexts(texts, special)
    ordinary = [i for i in range(len(texts)) if i not in special]
    expected = {"string": [i for i in ordinary if texts[i][:1] == '"'],
                "number": [i for i in ordinary if texts[i][:1] and texts[i][0] in ",}] "],
                "array": [i for i in ordinary if texts[i][:1] == "]"]}
    assert {k: v.tolist() for k, v in table.closers.items()} == expected
    assert table.structural.tolist() == [i for i in ordinary if any(c in texts[i] for c in '"}],')]
