"""Typed errors. Each carries a one-line, user-facing message; the CLI prints it without a traceback."""

from __future__ import annotations


class EdgeLLMError(Exception):
    """Base class for every error edgellm raises on purpose."""


class ModelNotFoundError(EdgeLLMError):
    """A model name or path that resolves to nothing."""


class UnsupportedModelError(EdgeLLMError):
    """A source model whose architecture or layout edgellm cannot run."""


class UnsupportedQuantizationError(EdgeLLMError):
    """An unknown quantization scheme, or one the source cannot be converted to."""


class ArtifactError(EdgeLLMError):
    """A missing, truncated, modified or malformed artifact file."""


class PullError(EdgeLLMError):
    """Fetching an embedded model from the package registry failed."""


class KernelUnavailableError(EdgeLLMError):
    """No matmul kernel for this (scheme, device, torch version) combination."""


class ContextOverflowError(EdgeLLMError):
    """A prompt that does not fit in the context window."""

    def __init__(self, prompt_tokens: int, context_window: int, reserved: int = 0) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window
        extra = f" (plus {reserved} tokens reserved for output)" if reserved else ""
        super().__init__(
            f"prompt is {prompt_tokens} tokens{extra} but the context window is {context_window} tokens"
        )


class MemoryBudgetError(EdgeLLMError):
    """The model's memory estimate exceeds the caller's budget."""


class SchemaError(EdgeLLMError):
    """A JSON Schema that is malformed, or uses a keyword that constrained decoding cannot enforce."""

    def __init__(self, message: str, *, keyword: str | None = None, pointer: str | None = None) -> None:
        self.keyword = keyword
        self.pointer = pointer
        super().__init__(message)


def pointer_token(key: str) -> str:
    """`key` as one reference token of a JSON Pointer (RFC 6901), as SchemaError.pointer spells its path."""
    return key.replace("~", "~0").replace("/", "~1")


class GrammarError(EdgeLLMError):
    """A malformed EBNF grammar or regular expression."""


class StructuredOutputError(EdgeLLMError):
    """Constrained output that is incomplete (cut off by max_tokens) or does not validate against its schema."""

    def __init__(self, message: str, *, text: str = "", finish_reason: str | None = None) -> None:
        self.text = text
        self.finish_reason = finish_reason
        super().__init__(message)
