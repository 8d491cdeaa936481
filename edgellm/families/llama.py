"""Llama (and SmolLM): the base layout, with llama.cpp's Q/K row permutation in GGUF."""

from __future__ import annotations

from edgellm.families.family import Family


class Llama(Family):
    name = "llama"
    hf_architectures = ("LlamaForCausalLM",)
    gguf_architecture = "llama"
    gguf_permuted_qk = True
