"""Tiny random models made by transformers, for unit tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 256


def _save_tokenizer(folder: Path) -> None:
    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<s>": VOCAB - 2, "</s>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def make_tiny(folder: Path, arch: str, *, tied: bool) -> torch.nn.Module:
    """A random 2-layer model with GQA, saved as safetensors with its tokenizer."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=50000.0, **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(rope_theta=1000000.0, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random biases so the Qwen2 q/k/v bias path is really exercised
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder)
    return model


def tiny_engine(root: Path, arch: str, *, tied: bool, quantization: str = "q0f32"):
    """A one-thread Engine over a freshly converted tiny random model in `root`."""
    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert
    from edgellm.runtime.engine import Engine

    make_tiny(root / "hf", arch, tied=tied)
    return Engine(open_artifact(convert(root / "hf", root / "art", quantization=quantization, progress=False)),
                  threads=1)
