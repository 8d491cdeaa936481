"""Build a Hugging Face `tokenizers` tokenizer from the tokenizer metadata stored in a GGUF file.

A GGUF carries no `tokenizer.json`: llama.cpp keeps the vocabulary, merges, token types and special
ids as metadata under `tokenizer.ggml.*`. This module turns those back into a `tokenizers.Tokenizer`
that splits text the way llama.cpp does for the file's pre-tokenizer type (`tokenizer.ggml.pre`).

Supported: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizers in
`_PRE_TOKENIZERS`, and SentencePiece-style vocabularies (`"llama"`, see gguf_spm.py). The tokenizer never adds BOS/EOS itself; callers consult `add_bos_token`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from edgellm.convert.gguf_spm import build_spm
from edgellm.errors import UnsupportedModelError

__all__ = ["GGUFTokenizer", "read_gguf_tokenizer"]

# llama.cpp token types (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

# Split regexes as llama.cpp's `llm_tokenizer_bpe` applies them: each regex in turn splits every
# piece left by the previous one, keeping matches and the text between them ("isolated").
# Contractions are spelled case-insensitively by hand, as llama.cpp does, instead of `(?i:...)`.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL

# pre type -> (split regexes in order, ignore_merges). llama.cpp matches a whole pre-token against
# the vocabulary before merging ("ignore_merges") for the Llama 3 family only.
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2,), False),
    "gpt-2": ((_GPT2,), False),
    "smollm": ((r"\p{N}", _GPT2), False),  # digits one by one, then GPT-2
    "qwen2": ((_QWEN2,), False),
    "deepseek-r1-qwen": ((_QWEN2,), False),
    "llama-bpe": ((_LLAMA3,), True),
    "llama3": ((_LLAMA3,), True),
    "llama-v3": ((_LLAMA3,), True),
}
_SUPPORTED_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece-style (convert/gguf_spm.py)

# Token texts llama.cpp treats as end-of-generation when present in the vocabulary.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "<|end_of_text|>", "<end_of_utterance>",
)


@dataclass(frozen=True)
class GGUFTokenizer:
    """A tokenizer rebuilt from GGUF metadata, plus the special-token facts a runtime needs."""

    tokenizer_json: str  # serialized tokenizers.Tokenizer (Tokenizer.to_str())
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    stop_token_ids: tuple[int, ...]  # eos plus end-of-turn tokens present in the vocabulary
    chat_template: str | None


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    """The decoded value of metadata `key`, or None when the file lacks it."""
    field = reader.fields.get(key)
    if field is None:
        return None
    if hasattr(field, "contents"):  # gguf >= 0.11
        return field.contents()
    is_str = field.types[-1] == gguf.GGUFValueType.STRING
    items = [bytes(field.parts[i]).decode("utf-8") if is_str else field.parts[i].tolist()[0] for i in field.data]
    return items if field.types[0] == gguf.GGUFValueType.ARRAY else items[0]


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _unsupported_pre(pre: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported GGUF pre-tokenizer {pre!r} for tokenizer model 'gpt2' "
        f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
    )


def _build_bpe(tokens: list[str], token_types: list[int], merges: list[str], pre: str) -> Tokenizer:
    """A byte-level BPE tokenizer with llama.cpp's split rules for `pre`."""
    if pre not in _PRE_TOKENIZERS:
        raise _unsupported_pre(pre)
    splits, ignore_merges = _PRE_TOKENIZERS[pre]

    spell = _byte_alphabet()
    alphabet = set(spell.values())
    special = {i for i, t in enumerate(token_types[: len(tokens)]) if t in (_CONTROL, _USER_DEFINED)}
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        token = token or f"[EMPTY_{i}]"  # as llama.cpp names empty entries
        # Control/user-defined tokens are stored as raw text and matched as added tokens; any other
        # token outside the byte alphabet is respelled into it so merges can reach it.
        if i not in special and not set(token) <= alphabet:
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)

    pairs: list[tuple[str, str]] = []
    for merge in merges:
        cut = merge.find(" ", 1)  # llama.cpp splits at the first space after the first character
        left, right = merge[:cut], merge[cut + 1 :]
        if cut > 0 and left in vocab and right in vocab and left + right in vocab:
            pairs.append((left, right))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=token_types[i] == _CONTROL, normalized=False)
        for i in sorted(special)
        if tokens[i] and vocab.get(tokens[i]) == i  # skip duplicates and empty entries
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])
    return tokenizer


def serialized(tokenizer: Tokenizer) -> str:
    """The tokenizer.json text, BPE merges written "left right" where no piece holds a space: `tokenizers`
    parses that form faster than [left, right] pairs (Gemma 3's 236,245 merges: 0.63 -> 0.46 s per load)."""
    spec = json.loads(tokenizer.to_str())
    merges = spec["model"].get("merges")
    if merges and all(isinstance(m, list) and " " not in m[0] + m[1] for m in merges):
        spec["model"]["merges"] = [f"{left} {right}" for left, right in merges]
    return json.dumps(spec, ensure_ascii=False, separators=(",", ":"))


def _token_id(reader: gguf.GGUFReader, key: str, n_tokens: int) -> int | None:
    value = _field(reader, key)
    return int(value) if value is not None and 0 <= int(value) < n_tokens else None


def read_gguf_tokenizer(reader: gguf.GGUFReader) -> GGUFTokenizer:
    """Rebuild the tokenizer described by `reader`'s `tokenizer.*` metadata.

    Raises UnsupportedModelError for tokenizer models or pre-tokenizers this module cannot reproduce.
    """
    model = _field(reader, "tokenizer.ggml.model")
    if model not in _SUPPORTED_MODELS:
        raise UnsupportedModelError(
            f"unsupported GGUF tokenizer model {model!r} (supported: {', '.join(_SUPPORTED_MODELS)})"
        )
    pre = _field(reader, "tokenizer.ggml.pre") or "default"  # llama.cpp's fallback too
    if model == "gpt2" and pre not in _PRE_TOKENIZERS:
        raise _unsupported_pre(pre)

    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise UnsupportedModelError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    token_types = [int(t) for t in (_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))]
    if model == "llama":
        scores = [float(x) for x in (_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens))]
        space = _field(reader, "tokenizer.ggml.add_space_prefix")
        tokenizer = build_spm(tokens, scores, token_types, add_space_prefix=True if space is None else bool(space))
    else:
        merges: list[str] = list(_field(reader, "tokenizer.ggml.merges") or [])
        tokenizer = _build_bpe(tokens, token_types, merges, pre)

    n = len(tokens)
    bos = _token_id(reader, "tokenizer.ggml.bos_token_id", n)
    eos = _token_id(reader, "tokenizer.ggml.eos_token_id", n)
    pad = _token_id(reader, "tokenizer.ggml.padding_token_id", n)
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp's default: SPM vocabularies and the Llama 3 family add BOS
        add_bos = model == "llama" or _PRE_TOKENIZERS[pre][1]

    stops: list[int] = []
    extra = [
        _token_id(reader, "tokenizer.ggml.eot_token_id", n),
        _token_id(reader, "tokenizer.ggml.eom_token_id", n),
    ]
    by_text = {t: i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
    for tid in [eos, *extra, *(by_text[t] for t in _EOG_TEXTS if t in by_text)]:
        if tid is not None and tid not in stops:
            stops.append(tid)

    template = _field(reader, "tokenizer.chat_template")
    return GGUFTokenizer(
        tokenizer_json=serialized(tokenizer),
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        add_bos_token=bool(add_bos),
        stop_token_ids=tuple(stops),
        chat_template=template or None,
    )
