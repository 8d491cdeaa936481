"""SentencePiece-style tokenizers stored in GGUF (`tokenizer.ggml.model == "llama"`, e.g. Gemma), rebuilt with `tokenizers`.

llama.cpp's SPM tokenizer writes spaces as "▁" (optionally prefixing one), then repeatedly joins the
adjacent pair whose joined piece is in the vocabulary with the highest score; characters no piece covers
fall back to their UTF-8 bytes (`<0xNN>` tokens). The same result comes from a BPE model whose merges
are every split of every piece, ranked by that piece's score, with byte fallback.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

SPACE = "▁"
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6  # gguf.TokenType


def build_spm(tokens: list[str], scores: list[float], token_types: list[int], *, add_space_prefix: bool) -> Tokenizer:
    """A tokenizer that splits text as llama.cpp's SPM tokenizer does for this vocabulary."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token or f"[EMPTY_{i}]", i)
    normal = [(i, t) for i, t in enumerate(tokens) if token_types[i] == _NORMAL and vocab.get(t) == i]
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, token in normal:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], left, right))
    ranked.sort()
    unk = next((t for i, t in enumerate(tokens) if t == "<unk>"), None)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(left, right) for *_, left, right in ranked],
                                     byte_fallback=True, unk_token=unk, fuse_unk=True))
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tail = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *tail])
    special = [AddedToken(t, special=True, normalized=False) for i, t in enumerate(tokens)
               if token_types[i] == _CONTROL and vocab.get(t) == i]
    user = [AddedToken(t, special=False, normalized=False) for i, t in enumerate(tokens)
            if token_types[i] == _USER_DEFINED and vocab.get(t) == i]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    return tokenizer
