"""Qwen3: the Llama layout plus an RMSNorm of every query and key head before RoPE."""

from __future__ import annotations

from edgellm.families.family import Family


class Qwen3(Family):
    name = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    gguf_architecture = "qwen3"
    qk_norm = True
