"""The gguf-py writer calls that the tests' hand-written GGUF files share: a model's shape and a placeholder vocabulary."""

from __future__ import annotations

from typing import Any

import gguf


def add_shape(w: gguf.GGUFWriter, cfg: Any) -> None:
    """The attention/MLP shape of a transformers config (`cfg`), as llama.cpp's converter writes it."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)


def add_placeholder_vocab(w: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level ("gpt2") vocabulary of `vocab` tokens: t0, t1, ... then <s> (BOS) and </s> (EOS), both control."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(vocab - 2)] + ["<s>", "</s>"])
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
