"""SentencePiece-style vocabularies rebuilt as BPE (convert/gguf_spm.py) against a direct implementation of
llama.cpp's SPM algorithm: join the adjacent pair whose joined piece scores highest, leftmost first."""

from __future__ import annotations

import random

import pytest

from edgellm.convert.gguf_spm import SPACE, build_spm, canonical_merges

_NORMAL, _CONTROL, _BYTE = 1, 3, 6


def spm_reference(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's SPM tokenization, written plainly: O(n^2), no merges table."""
    symbols = list(text.replace(" ", SPACE))
    while True:
        best: tuple[float, int] | None = None
        for j in range(len(symbols) - 1):
            joined = symbols[j] + symbols[j + 1]
            if joined in vocab and (best is None or scores[vocab[joined]] > best[0]):
                best = (scores[vocab[joined]], j)
        if best is None:
            break
        j = best[1]
        symbols[j : j + 2] = [symbols[j] + symbols[j + 1]]
    ids: list[int] = []
    for symbol in symbols:
        if symbol in vocab:
            ids.append(vocab[symbol])
        else:  # byte fallback
            ids.extend(vocab[f"<0x{b:02X}>"] for b in symbol.encode("utf-8"))
    return ids


def random_vocab(rng: random.Random, alphabet: str, n_pieces: int) -> tuple[list[str], list[float], list[int]]:
    """Bytes, the alphabet's characters, then random multi-character pieces with distinct random scores."""
    tokens = ["<unk>", "<s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [_CONTROL, _CONTROL] + [_BYTE] * 256
    pieces = list(dict.fromkeys(alphabet))
    while len(pieces) < n_pieces:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6)))
        if piece not in pieces:
            pieces.append(piece)
    tokens += pieces
    types += [_NORMAL] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + rng.sample(range(-10 * n_pieces, 0), len(pieces))
    return tokens, [float(s) for s in scores], types


@pytest.mark.parametrize("seed", range(6))
def test_spm_as_bpe_splits_like_the_spm_algorithm(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = SPACE + "abcde" + "xy"
    tokens, scores, types = random_vocab(rng, alphabet, 400)
    tokenizer = build_spm(tokens, scores, types, add_space_prefix=False)
    vocab = {t: i for i, t in enumerate(tokens)}
    for _ in range(300):
        text = "".join(rng.choice("abcde xyzé") for _ in range(rng.randint(1, 40)))  # z, é: byte fallback
        assert tokenizer.encode(text, add_special_tokens=False).ids == spm_reference(text, vocab, scores), text


def test_only_canonical_splits_are_kept() -> None:
    # "abc" has two splits; "ab" scores higher than "bc", so a..b joins first and (a, bc) can never fire
    merges = [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]
    assert canonical_merges(merges) == [("a", "b"), ("b", "c"), ("ab", "c")]
    # a piece the characters can never reach (no split of "q" + "r" joins them) keeps nothing
    assert canonical_merges([("qq", "r")]) == []
