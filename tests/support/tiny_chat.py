"""A tiny random chat model (transformers → edgellm artifact) for the fuzz tests: fast to load and to run.

Its tokenizer is byte-level (one token per byte, no merges), so any text, JSON included, can be generated:
constrained decoding works on it as on a real model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.support.tiny import VOCAB, make_tiny

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _byte_tokenizer(folder: Path) -> None:
    """Overwrite the tiny model's tokenizer with a byte-level one: bytes 0..253 (0xFE/0xFF never occur in UTF-8),
    then <s> and </s> at the ids make_tiny gave them."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = _byte_chars()
    vocab = {byte_chars[b]: b for b in range(VOCAB - 2)} | {"<s>": VOCAB - 2, "</s>": VOCAB - 1}
    assert set(byte_chars.values()) <= set(alphabet)
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte → printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def tiny_chat_engine(root: Path) -> Any:
    """A one-thread Engine over a converted tiny llama with a byte tokenizer and a chat template (256 tokens)."""
    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert
    from edgellm.runtime.engine import Engine

    make_tiny(root / "hf", "llama", tied=True)
    _byte_tokenizer(root / "hf")
    (root / "hf" / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    art = convert(root / "hf", root / "art", quantization="q0f32", progress=False)
    return Engine(open_artifact(art), threads=1)
