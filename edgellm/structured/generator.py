"""What structured's helpers (`api.chat_json`, `fallback.generate_json`) call on an engine: runtime.engine.Engine
has it, and runtime imports structured, never the other way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from edgellm.generation import GenerationParams, GenerationResult


class Generator(Protocol):
    """Runs a request to completion: from a prompt (text or token ids), or from chat messages."""

    def generate(self, prompt: str | Sequence[int], params: GenerationParams | None = None) -> GenerationResult: ...

    def chat(self, messages: Sequence[dict[str, Any]], params: GenerationParams | None = None,
             **render_kwargs: Any) -> GenerationResult: ...
