"""Qwen2 / Qwen2.5: the Llama layout with a bias on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from edgellm.families.family import Family


class Qwen2(Family):
    name = "qwen2"
    hf_architectures = ("Qwen2ForCausalLM",)
    gguf_architecture = "qwen2"

    def extra_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        return {"attention_bias": True}  # config.json does not say; Qwen2 always has it
