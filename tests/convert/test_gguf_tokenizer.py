"""The GGUF tokenizer against an independent reference: transformers' own GGUF tokenizer loader."""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from edgellm.convert.gguf_tokenizer import GGUFTokenizer, read_gguf_tokenizer
from edgellm.errors import UnsupportedModelError

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces; a model sees only the pieces' ids.",
    "人工智能正在改变世界。我们今天去公园散步，天气很好！",
    "Mixed 中文 and English: 模型 model, 数据 data (2024年).",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tdef bar(self):\n\t\treturn [x ** 2 for x in range(10)]\n",
    "if (x >= 10 && y != 0) { z = x / y; }  // comment\r\n",
    "Numbers: 1234567, 3.14, -0.5e10, 1,000,000 and 007; a  1 b   22",
    "lots of    spaces   here \n\n\n\n and newlines\n \n\t \n",
    "   leading and trailing   ",
    "Emoji: 😀 👍🏽 🇫🇷 ❤️ — done…",
    "don't I'LL we've they're it's O'Neil's 'quoted' \"double\"",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "café naïve résumé e\u0301 ² ½ ٣ ſ K",
    "",
    " ",
    "\n",
]

@lru_cache(maxsize=None)
def _ours(path: Path) -> tuple[GGUFTokenizer, Tokenizer]:
    built = read_gguf_tokenizer(gguf.GGUFReader(path))
    return built, Tokenizer.from_str(built.tokenizer_json)


@lru_cache(maxsize=None)
def _reference(path: Path):  # -> transformers tokenizer
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if "SmolLM" in path.name:
        # transformers' GGUF loader does not know pre type "smollm" and falls back to plain GPT-2
        # ByteLevel. SmolLM2's own tokenizer.json (and llama.cpp) split digits first, which differs
        # on a whitespace run before a digit ("a  1" -> "a", "ĠĠ", "1" rather than "a", "Ġ", "Ġ", "1").
        # Restore the original model's pre-tokenizer; vocab, merges and added tokens stay transformers'.
        ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return ref


def _fuzz_corpus(n: int, seed: int = 0) -> list[str]:
    pool = list("abcXYZ '’sStTlLdD0123456789 \n\n\r\t  .,;:!?()[]{}<>\"#$%^&*-_=+/\\|~`") + [
        "你", "好", "世界", "😀", "👍🏽", "é", "e\u0301", "²", "½", "ſ", "  ", "    ", "\u00a0", "\u3000",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    ]
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def _check_against_reference(path: Path) -> None:
    _, ours = _ours(path)
    ref = _reference(path)
    mismatches = []
    for text in CORPUS + _fuzz_corpus(400):
        got = ours.encode(text, add_special_tokens=False).ids
        want = ref(text, add_special_tokens=False).input_ids
        if got != want:
            mismatches.append((text, got, want))
        decoded = ours.decode(got, skip_special_tokens=False)
        assert decoded == text, f"round trip of {text!r} gave {decoded!r}"
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]!r}"


def test_smollm2_encode_matches_transformers(smollm2_gguf: Path) -> None:
    _check_against_reference(smollm2_gguf)


def test_qwen_encode_matches_transformers(qwen_gguf: Path) -> None:
    _check_against_reference(qwen_gguf)


def _check_against_llama_cpp(path: Path) -> None:
    """Our tokenizer against llama.cpp's own tokenization of the same GGUF (no pre-tokenizer patched:
    the independent reference for SmolLM2's "smollm" pre-tokenizer, which transformers does not know)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the compare extra) is not installed")
    _, ours = _ours(path)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    mismatches = []
    for text in CORPUS + _fuzz_corpus(400, seed=1):
        got = ours.encode(text, add_special_tokens=False).ids
        want = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if got != want:
            mismatches.append((text, got, want))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]!r}"


def test_smollm2_encode_matches_llama_cpp(smollm2_gguf: Path) -> None:
    _check_against_llama_cpp(smollm2_gguf)


@pytest.mark.slow
def test_qwen_encode_matches_llama_cpp(qwen_gguf: Path) -> None:
    _check_against_llama_cpp(qwen_gguf)


def test_smollm2_splits_digits_like_llama_cpp(smollm2_gguf: Path) -> None:
    _, ours = _ours(smollm2_gguf)
    vocab = ours.get_vocab()
    assert ours.encode("a  1", add_special_tokens=False).ids == [vocab["a"], vocab["ĠĠ"], vocab["1"]]
    assert ours.encode("1234567", add_special_tokens=False).ids == [vocab[d] for d in "1234567"]


def test_qwen_splits_single_digits(qwen_gguf: Path) -> None:
    _, ours = _ours(qwen_gguf)
    vocab = ours.get_vocab()
    assert ours.encode("2024", add_special_tokens=False).ids == [vocab[d] for d in "2024"]


@pytest.mark.parametrize("name", ["smollm2", "qwen"])
def test_metadata_matches_transformers(name: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(f"{name}_gguf")
    built, ours = _ours(path)
    ref = _reference(path)
    assert built.bos_token_id == ref.bos_token_id
    assert built.eos_token_id == ref.eos_token_id
    assert built.pad_token_id == ref.pad_token_id
    assert built.add_bos_token is False  # both files say so; llama.cpp adds no BOS for them
    assert built.chat_template and built.chat_template == ref.chat_template
    im_end = ref.convert_tokens_to_ids("<|im_end|>")
    endoftext = ref.convert_tokens_to_ids("<|endoftext|>")
    assert built.stop_token_ids[0] == built.eos_token_id
    assert {im_end, endoftext} <= set(built.stop_token_ids)
    # Every control / user-defined token is matched whole, whatever surrounds it.
    for token in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"] + (["<tool_call>"] if name == "qwen" else []):
        tid = ref.convert_tokens_to_ids(token)
        assert ours.encode(f"x{token}y", add_special_tokens=False).ids[1] == tid
        assert ours.decode([tid], skip_special_tokens=False) == token
    # The tokenizer itself never adds BOS/EOS; add_bos_token is the caller's job.
    assert ours.encode("hi").ids == ours.encode("hi", add_special_tokens=False).ids


# --- synthetic files -----------------------------------------------------------------------------


def _write_gguf(path: Path, model: str, pre: str | None, tokens: list[str], merges: list[str],
                token_types: list[int] | None = None, add_bos: bool | None = None) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types or [1] * len(tokens))
    writer.add_token_merges(merges)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def _byte_tokens() -> list[str]:
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    reader = _write_gguf(tmp_path / "t5.gguf", "t5", None, ["<unk>", "<s>", "</s>", "▁a"], [])
    with pytest.raises(UnsupportedModelError) as info:
        read_gguf_tokenizer(reader)
    message = str(info.value)
    assert "'t5'" in message and "gpt2" in message and "\n" not in message


def test_unsupported_pre_tokenizer(tmp_path: Path) -> None:
    reader = _write_gguf(tmp_path / "pre.gguf", "gpt2", "mystery-pre", _byte_tokens(), [])
    with pytest.raises(UnsupportedModelError) as info:
        read_gguf_tokenizer(reader)
    message = str(info.value)
    assert "mystery-pre" in message and "qwen2" in message and "smollm" in message and "\n" not in message


def test_llama3_ignores_merges_and_adds_bos(tmp_path: Path) -> None:
    # "abc" is in the vocabulary but no merge reaches it: Llama 3 (llama.cpp's ignore_merges) takes the
    # whole word, GPT-2 merges its way to "ab" + "c".
    tokens = [*_byte_tokens(), "ab", "abc", "<|eot_id|>", "<|begin_of_text|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    ids = {t: i for i, t in enumerate(tokens)}
    llama = read_gguf_tokenizer(_write_gguf(tmp_path / "l3.gguf", "gpt2", "llama-bpe", tokens, ["a b"], types))
    gpt2 = read_gguf_tokenizer(_write_gguf(tmp_path / "g2.gguf", "gpt2", "gpt-2", tokens, ["a b"], types))
    assert Tokenizer.from_str(llama.tokenizer_json).encode("abc").ids == [ids["abc"]]
    assert Tokenizer.from_str(gpt2.tokenizer_json).encode("abc").ids == [ids["ab"], ids["c"]]
    assert llama.add_bos_token is True and gpt2.add_bos_token is False  # llama.cpp defaults
    assert llama.stop_token_ids == (ids["<|eot_id|>"],)
    assert llama.chat_template is None and llama.bos_token_id is None
    assert Tokenizer.from_str(llama.tokenizer_json).encode("<|begin_of_text|>ab").ids == [
        ids["<|begin_of_text|>"], ids["ab"]
    ]


def test_merges_are_written_as_strings_only_where_no_piece_holds_a_space() -> None:
    from tokenizers import models

    from edgellm.convert.gguf_tokenizer import serialized

    vocab = {c: i for i, c in enumerate(["a", "b", " ", "ab", "a ", "a b"])}
    plain = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    spaced = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("a", " "), ("a ", "b")]))
    assert json.loads(serialized(plain))["model"]["merges"] == ["a b"]
    assert json.loads(serialized(spaced))["model"]["merges"][1] == ["a", " "]  # "a  " would not split back
    for tok in (plain, spaced):
        assert Tokenizer.from_str(serialized(tok)).encode("abab").ids == tok.encode("abab").ids
