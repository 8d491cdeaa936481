"""OpenAI wire types (pydantic), with OpenAI's field names. The engine never imports this module."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# Below these a sampling value does nothing more (a temperature under MIN_TEMPERATURE already picks the top token,
# a repetition penalty past the range already forbids or forces every repeat) but can overflow the sampler's
# float32 arithmetic into NaN (1e-300 rounds to 0.0 in float32): a 400 naming the field instead.
MIN_TEMPERATURE = 1e-3
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
LONE_SURROGATE = "lone_surrogate"  # the validation error type a string holding one raises (errors.py reads it)


def refuse_lone_surrogates(value: Any) -> None:
    """Raise a validation error naming the first string (or key) in a parsed JSON value that holds a lone UTF-16
    surrogate ("\\ud800" in JSON decodes to one): it is not text, and the tokenizer cannot encode it."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for key, item in node.items():
                if isinstance(key, str):
                    _check_text(key, path, f"a key in {path or 'the request body'}")
                stack.append((item, f"{path}.{key}" if path else str(key)))
        elif isinstance(node, list):
            stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(node))
        elif isinstance(node, str):
            _check_text(node, path, path)


def _check_text(text: str, param: str, what: str) -> None:
    """`param`: the field's path, for the error's `param`; `what`: the same in words, for its message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(LONE_SURROGATE, "{what} holds a lone surrogate ({code} at character {at}), "
                                  "which is not Unicode text; send the character itself or a valid pair",
                                  {"param": param, "what": what, "code": f"\\u{ord(text[exc.start]):04x}",
                                   "at": exc.start}) from None


class _Wire(BaseModel):
    """Unknown fields are ignored, as OpenAI-compatible servers do, so newer clients keep working."""

    model_config = ConfigDict(extra="ignore")


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class FunctionCall(_Wire):
    name: str
    arguments: str = "{}"


class ToolCall(_Wire):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_given(self) -> "ChatMessage":
        """As OpenAI: only an assistant message that carries tool_calls may have null content."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is null; it must be a string or a list of text parts (only an assistant "
                             "message with tool_calls may omit it)")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDef(_Wire):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Wire):
    include_usage: bool = False


class _SamplingFields(_Wire):
    """The fields /v1/chat/completions and /v1/completions share. Every float must be finite (NaN and Infinity,
    which Python's JSON reader accepts, are refused) and every string valid Unicode."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=REPETITION_PENALTY_RANGE[0],
                                             le=REPETITION_PENALTY_RANGE[1])
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=8)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None  # edgellm reads its routing markers from it (router/decide.py)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        refuse_lone_surrogates(value)
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature {value!r} is below {MIN_TEMPERATURE:g}: send 0 for greedy decoding or "
                             f"a value in {MIN_TEMPERATURE:g}..2")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias key {key!r} is not a token id")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias value {bias} for token {key} is outside -100..100")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: Union[str, list[str], None]) -> Union[str, list[str], None]:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None

    def token_limit(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None  # extension: structured output on plain completions

    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for /v1/completions


class Usage(_Wire):
    """Standard counts plus edgellm's timing fields (extra keys OpenAI clients keep as-is)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] = Field(default_factory=dict)
    ttft_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    total_s: float = 0.0
    guard_interventions: int = 0  # steps where the JSON loop guard changed the logits (never silent)
    draft_tokens: int = 0  # speculative decoding (--speculative): tokens drafted, and of them kept
    accepted_tokens: int = 0
