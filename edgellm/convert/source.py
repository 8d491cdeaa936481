"""What every source reader (GGUF, Hugging Face folder) hands to the converter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from edgellm.artifact.config import ModelConfig, SamplingDefaults, SourceInfo, TokenizerConfig


@dataclass(frozen=True)
class SourceModel:
    """A source model, read lazily: tensors are produced one by one in Hugging Face naming, float32."""

    info: SourceInfo
    config: ModelConfig
    tokenizer_json: str
    tokenizer: TokenizerConfig
    chat_template: str | None
    sampling: SamplingDefaults
    tensor_names: tuple[str, ...]
    load_tensor: Callable[[str], torch.Tensor]
    # Weight formats ("q4", "q8") a tensor is stored in *exactly* by the source (a GGUF Q4_1 tensor is
    # q4 block for block), and the block rows of it in such a format (None if it turns out not exact).
    exact_formats: Callable[[str], tuple[str, ...]] = lambda name: ()
    load_blocks: Callable[[str, str], torch.Tensor | None] = lambda name, fmt: None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.tensor_names:
            yield name, self.load_tensor(name)


def expected_tensor_names(config: ModelConfig) -> list[str]:
    """The Hugging Face tensor names a model of this config must provide."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
        names += [f"{p}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if config.attention_bias:
            names += [f"{p}.self_attn.{n}_proj.bias" for n in ("q", "k", "v")]
    return names
