"""SentencePiece-style tokenizers stored in GGUF (`tokenizer.ggml.model == "llama"`, e.g. Gemma), rebuilt with `tokenizers`.

llama.cpp's SPM tokenizer writes spaces as "▁" (optionally prefixing one), then repeatedly joins the
adjacent pair whose joined piece is in the vocabulary with the highest score; characters no piece covers
fall back to their UTF-8 bytes (`<0xNN>` tokens). The same result comes from a BPE model whose merges
are every split of every piece, ranked by that piece's score, with byte fallback.

Most of those merges can never fire, and the tokenizer's load time grows with their number (Gemma 3:
513,511 merges, 0.83 s of a 0.9 s load). Only one split of a piece ever forms it: merges never cross
the boundary of a symbol that ends up whole, so the merges inside a piece's span happen exactly as they
would on the piece's characters alone, ending in one split — its *canonical* split. Any other split
whose halves are both formed would already have been the cheapest pair and formed the piece itself,
so keeping only canonical splits (same ranks, same order) splits every text the same way.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

SPACE = "▁"
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6  # gguf.TokenType


def canonical_merges(merges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The merges (in rank order) that can fire: for each piece, the split that forms it when BPE with all
    of `merges` runs on the piece's characters alone; pieces that run never forms contribute nothing."""
    rank = {pair: r for r, pair in enumerate(merges)}
    kept: set[tuple[str, str]] = set()
    for piece in {left + right for left, right in merges}:
        symbols = list(piece)
        last: tuple[str, str] | None = None
        while len(symbols) > 1:
            best, at = len(merges), -1
            for j in range(len(symbols) - 1):
                r = rank.get((symbols[j], symbols[j + 1]), best)
                if r < best:
                    best, at = r, j
            if at < 0:
                break
            last = (symbols[at], symbols[at + 1])
            symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
        if len(symbols) == 1 and last is not None:
            kept.add(last)
    return [pair for pair in merges if pair in kept]


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
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=canonical_merges([(left, right) for *_, left, right in ranked]),
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
