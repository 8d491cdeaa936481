"""Runtime tokenizer and streaming detokenizer, on tiny tokenizers trained inside the test."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from edgellm.errors import ArtifactError
from edgellm import tokenizer as tokenizer_module
from edgellm.tokenizer import StreamingDetokenizer, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "机器学习和自然语言处理是人工智能的重要领域。",
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "😀😃😄 emoji 🎉🚀 test 👍🏽 家族👨‍👩‍👧",
    "混合 mixed text 中文 and English 123.",
] * 20
# Long text with characters the tiny vocabularies never saw whole, so their UTF-8 bytes spread over several tokens.
STREAM_TEXT = (
    "今天天气很好，我们一起去公园散步吧！😀🎉 Hello 世界👍🏽 龍が如く、鬱陶しい。"
    "机器学习 mixed with English words and 🚀🚀 rockets, 家族👨‍👩‍👧 and ünïcödé. "
) * 30


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, as the ByteLevel pre-tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


@pytest.fixture(scope="module")
def bytelevel_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("bytelevel") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def sentencepiece_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-style: "▁" for spaces, byte-fallback tokens, a decoder that strips the first leading space."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = HFTokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", *byte_tokens], limit_alphabet=60, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("spm") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tok(bytelevel_path: Path) -> Tokenizer:
    return Tokenizer.from_file(bytelevel_path, bos_token_id=0, eos_token_id=2, add_bos_token=False)


def stream(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    detok = StreamingDetokenizer(tokenizer)
    return [detok.add(i) for i in ids], detok.flush()


def test_encode_recognizes_special_tokens_and_decodes_back(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\n你好 world<|im_end|>\n")
    assert ids[0] == 1 and 2 in ids
    assert tok.decode(ids) == "<|im_start|>user\n你好 world<|im_end|>\n"
    assert tok.decode(tok.encode(STREAM_TEXT)) == STREAM_TEXT
    assert tok.vocab_size == 400
    assert (tok.bos_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.id_to_token(1) == "<|im_start|>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_token(400)
    assert tok.stop_token_ids == frozenset({2})


def test_bos_is_added_once_when_asked(bytelevel_path: Path) -> None:
    tok = Tokenizer.from_file(bytelevel_path, bos_token_id=0, eos_token_id=2, add_bos_token=True, stop_token_ids=[1])
    plain = tok.encode("hi", add_bos=False)
    assert tok.encode("hi") == [0, *plain]
    assert tok.encode("<|endoftext|>hi") == [0, *plain], "a BOS already in the text is not doubled"
    assert tok.encode("") == [0]
    assert tok.stop_token_ids == frozenset({1, 2})
    no_bos = Tokenizer.from_file(bytelevel_path, bos_token_id=None, add_bos_token=True)
    assert no_bos.encode("hi") == plain and no_bos.bos_token == ""


def test_load_errors_are_one_line_artifact_errors(tmp_path: Path, bytelevel_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": ')
    for path in (tmp_path / "missing.json", bad):
        with pytest.raises(ArtifactError, match="cannot load tokenizer") as info:
            Tokenizer.from_file(path)
        assert "\n" not in str(info.value)
    with pytest.raises(ArtifactError, match="bos_token_id 400 is outside the vocabulary"):
        Tokenizer.from_file(bytelevel_path, bos_token_id=400)
    with pytest.raises(ArtifactError, match="stop token id -1"):
        Tokenizer.from_file(bytelevel_path, stop_token_ids=[-1])


def test_tiny_vocabulary_really_splits_characters(tok: Tokenizer) -> None:
    ids = tok.encode(STREAM_TEXT)
    alone = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in s for s in alone) > len(ids) // 4, "test tokenizer must split multi-byte characters"


@pytest.mark.parametrize("which", ["bytelevel", "sentencepiece"])
def test_streaming_never_emits_partial_characters(which: str, request: pytest.FixtureRequest) -> None:
    tok = Tokenizer.from_file(request.getfixturevalue(f"{which}_path"))
    ids = tok.encode(STREAM_TEXT)
    assert len(ids) > 1000
    pieces, tail = stream(tok, ids)
    for piece in [*pieces, tail]:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # no lone surrogates
    assert "".join(pieces) + tail == tok.decode(ids) == STREAM_TEXT
    assert tail == ""
    assert sum(bool(p) for p in pieces) > len(ids) // 3, "text is emitted as it goes, not at the end"


def test_sentencepiece_spaces_need_context(sentencepiece_path: Path) -> None:
    """Decoding tokens one by one loses the spaces the Strip decoder removes; the window's context keeps them."""
    tok = Tokenizer.from_file(sentencepiece_path)
    text = "Hello world and 中文 words"
    ids = tok.encode(text)
    assert "".join(tok.decode([i]) for i in ids) != text
    pieces, tail = stream(tok, ids)
    assert "".join(pieces) + tail == text


def test_streaming_holds_a_bounded_window(bytelevel_path: Path) -> None:
    """O(1) per token: every decode call sees only a short suffix, never the history."""
    sizes: list[int] = []

    class Counting(Tokenizer):
        def decode(self, ids: list[int]) -> str:
            sizes.append(len(ids))
            return super().decode(ids)

    counting = Counting.from_file(bytelevel_path)
    windows = []
    for repeat in (1, 4):
        sizes.clear()
        ids = counting.encode(STREAM_TEXT * repeat)
        pieces, tail = stream(counting, ids)
        assert "".join(pieces) + tail == STREAM_TEXT * repeat
        windows.append(max(sizes))
        assert sum(sizes) <= 10 * len(ids)
    assert windows[0] == windows[1] <= 2 * tokenizer_module._MAX_PENDING + 1, "window grows with history"


def byte_token(path: Path, byte: int) -> int:
    """Id of the byte-level token that is the single byte `byte`."""
    return HFTokenizer.from_file(str(path)).token_to_id(bytes_to_unicode()[byte])


def test_a_character_cut_at_the_end_is_dropped_not_replaced(tok: Tokenizer, bytelevel_path: Path) -> None:
    whole = tok.encode("好的")
    for cut in (1, 2):  # the first one or two bytes of a 3-byte character, as a cut at max_tokens leaves them
        ids = [*whole, *[byte_token(bytelevel_path, b) for b in "中".encode()[:cut]]]
        assert tok.decode(ids).endswith("\ufffd")
        pieces, tail = stream(tok, ids)
        assert "".join(pieces) == "好的" and tail == ""


def test_long_invalid_run_is_emitted_without_unbounded_holding(tok: Tokenizer, bytelevel_path: Path) -> None:
    continuation = byte_token(bytelevel_path, 0x80)  # a lone continuation byte is never valid
    ids = [*tok.encode("ok "), *[continuation] * 300, *tok.encode(" 好")]
    pieces, tail = stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) == "ok " + "\ufffd" * 300 + " 好"
    held = 0
    for piece in pieces:
        held = 0 if piece else held + 1
        assert held <= tokenizer_module._MAX_PENDING


def test_flush_with_nothing_pending_and_reuse(tok: Tokenizer) -> None:
    detok = StreamingDetokenizer(tok)
    assert detok.flush() == ""
    first = "".join(detok.add(i) for i in tok.encode("你好")) + detok.flush()
    second = "".join(detok.add(i) for i in tok.encode("世界")) + detok.flush()
    assert (first, second) == ("你好", "世界")
