"""Gemma 3 270M (Q4_K/Q6_K/Q5_0/Q8_0 tensors, SentencePiece vocabulary) against transformers' GGUF loader."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from gguf import GGUFReader
from tokenizers import Tokenizer

from edgellm.convert.gguf_tokenizer import read_gguf_tokenizer
from tests.e2e.test_reference_gguf import TEXT, _compare_with_transformers

transformers = pytest.importorskip("transformers")

SAMPLES = [TEXT, "What is the capital of France?", "  two  spaces\n\nnew lines\t tab",
           "中文 测试 ünïcödé 🙂 <start_of_turn>user\nhi<end_of_turn>", "x" * 50 + " 12345 3.14159"]


@pytest.mark.slow
def test_gemma3_tokenizer_matches_transformers(gemma3_gguf: Path) -> None:
    ours = Tokenizer.from_str(read_gguf_tokenizer(GGUFReader(gemma3_gguf)).tokenizer_json)
    ref = transformers.AutoTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)
    # and runs of random vocabulary pieces: transformers keeps every split (514,906 merges), ours the ~236,000 that fire
    rng = random.Random(0)
    pieces = sorted(ours.get_vocab())
    runs = ["".join(rng.choice(pieces).replace("▁", " ") for _ in range(rng.randint(1, 30))) for _ in range(200)]
    for text in SAMPLES + runs:
        assert ours.encode(text, add_special_tokens=False).ids == ref.encode(text, add_special_tokens=False), text


@pytest.mark.slow
def test_gemma3_q0f32_matches_transformers(gemma3_gguf: Path) -> None:
    _compare_with_transformers(gemma3_gguf, "gemma3-270m", 300)
