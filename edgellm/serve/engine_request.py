"""The one conversion from OpenAI wire requests to engine requests (prompt token ids + GenerationParams)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, Union

from edgellm.errors import ContextOverflowError
from edgellm.generation import GenerationParams
from edgellm.serve.errors import APIError
from edgellm.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, NamedToolChoice, Tool
from edgellm.response_format import ResponseFormat, guard_options_from_openai

if TYPE_CHECKING:
    from edgellm.runtime.engine import Engine

ToolMode = Literal["none", "auto", "forced"]

TOOL_INSTRUCTIONS = (
    "You can call the following tools. To call one, reply with only a JSON object of the form "
    '{{"name": <tool name>, "arguments": <an object matching the tool\'s parameters>}}{extra}\nTools:\n{tools}'
)


@dataclass(frozen=True)
class EngineRequest:
    """What the engine runs for one HTTP request: one (prompt, params) per choice, and how to read the output."""

    prompts: tuple[list[int], ...]  # one per choice, in choice order
    params: tuple[GenerationParams, ...]
    tool_mode: ToolMode = "none"
    tool_names: tuple[str, ...] = ()


def to_engine(request: Union[ChatCompletionRequest, CompletionRequest], engine: Engine) -> EngineRequest:
    """Convert a validated wire request for `engine`; raises APIError (400) or ContextOverflowError."""
    base = _params(request, engine)
    mode: ToolMode = "none"
    names: tuple[str, ...] = ()
    texts: list[str | list[int]]  # one per prompt: text, or token ids
    if isinstance(request, ChatCompletionRequest):
        mode, tools = _tool_mode(request)
        names = tuple(t.function.name for t in tools)
        if mode == "forced":
            if request.response_format is not None and request.response_format.get("type", "text") != "text":
                raise APIError(400, "response_format cannot be combined with a forced tool_choice",
                               param="response_format")
            base = replace(base, response_format=_tool_call_format(tools))
        texts = [_render_chat(request.messages, tools if mode != "none" else [], engine, auto=mode == "auto")]
    else:
        _refuse_unsupported(request)
        prompt = request.prompt
        if isinstance(prompt, str):
            texts = [prompt]
        elif _token_ids(prompt):
            texts = [list(prompt)]  # one prompt given as token ids
        else:
            texts = [str(p) for p in prompt]  # one prompt per string
    prompts: list[list[int]] = []
    params: list[GenerationParams] = []
    for text in texts:
        ids = list(text) if isinstance(text, list) else engine.encode(text)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if any(not 0 <= i < engine.tokenizer.vocab_size for i in ids):
            raise APIError(400, "the prompt holds a token id outside the vocabulary", param="prompt")
        if len(ids) >= engine.context_window:
            raise ContextOverflowError(len(ids), engine.context_window)
        for i in range(request.n):  # n > 1 runs one after another, with seeds seed, seed+1, ...
            prompts.append(ids)
            params.append(replace(base, seed=None if base.seed is None else base.seed + i))
    return EngineRequest(tuple(prompts), tuple(params), mode, names)


def _token_ids(prompt: list[str] | list[int]) -> TypeGuard[list[int]]:
    """Whether a list prompt is token ids (an empty one counts as ids: refused as an empty prompt)."""
    return all(isinstance(p, int) for p in prompt)


def _refuse_unsupported(request: CompletionRequest) -> None:
    """echo, suffix and best_of > 1 are refused (400, naming the field given) rather than ignored."""
    given = [name for name, used in (("echo", request.echo), ("suffix", request.suffix is not None),
                                     ("best_of", (request.best_of or 1) > 1)) if used]
    if given:
        raise APIError(400, f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not supported on "
                       "/v1/completions", param=given[0])


def _params(request: Union[ChatCompletionRequest, CompletionRequest], engine: Engine) -> GenerationParams:
    vocab = engine.tokenizer.vocab_size
    bias: dict[int, float] | None = None
    if request.logit_bias:
        bias = {int(k): v for k, v in request.logit_bias.items()}
        if any(k >= vocab for k in bias):
            raise APIError(400, f"logit_bias names a token id outside the vocabulary (0..{vocab - 1})",
                           param="logit_bias")
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        top = (request.top_logprobs or 0) if request.logprobs else None
    else:
        top = request.logprobs
    return GenerationParams(
        max_tokens=request.token_limit(), temperature=request.temperature, top_p=request.top_p,
        top_k=request.top_k, min_p=request.min_p, repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        logit_bias=bias, seed=request.seed, stop=request.stop_list(), top_logprobs=top,
        response_format=_response_format(request.response_format),
        **guard_options_from_openai(request.response_format),
    )


def _response_format(wire: dict[str, Any] | None) -> ResponseFormat | None:
    """OpenAI's response_format (plus the grammar/regex extensions) → ResponseFormat; None for plain text."""
    if wire is None:
        return None
    from edgellm.structured import response_format_from_openai  # raises SchemaError on a bad shape

    fmt = response_format_from_openai(wire)
    return None if fmt.type == "text" else fmt


def _tool_mode(request: ChatCompletionRequest) -> tuple[ToolMode, list[Tool]]:
    tools = list(request.tools or [])
    choice = request.tool_choice if request.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return "none", []
    if not tools:
        raise APIError(400, "tool_choice needs a non-empty tools list", param="tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tool names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice):
        picked = [t for t in tools if t.function.name == choice.function.name]
        if not picked:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        return "forced", picked
    return ("forced" if choice == "required" else "auto"), tools


def _tool_call_format(tools: list[Tool]) -> ResponseFormat:
    """A JSON Schema for {"name": <a tool name>, "arguments": <that tool's parameters>}, one branch per tool."""
    branches = [{
        "type": "object",
        "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return ResponseFormat(type="json_schema", schema=schema, name="tool_call", strict=True)


def _render_chat(messages: list[ChatMessage], tools: list[Tool], engine: Engine, *, auto: bool) -> str:
    """Messages → prompt text with the model's template; tools go to the template, or into the system message."""
    native = bool(tools) and "tools" in (engine.chat_template or "")
    out: list[dict[str, Any]] = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": message.text()}
        if message.tool_calls:
            calls = [{"name": c.function.name, "arguments": _json_arguments(c.function.arguments)}
                     for c in message.tool_calls]
            if native:
                entry["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            elif not entry["content"]:
                entry["content"] = "\n".join(json.dumps(c) for c in calls)
        if message.role == "tool" and message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    if tools and not native:
        described = json.dumps([{"name": t.function.name, "description": t.function.description or "",
                                 "parameters": t.function.parameters} for t in tools])
        text = TOOL_INSTRUCTIONS.format(extra="; otherwise reply normally." if auto else ".", tools=described)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    wire_tools = [t.model_dump(exclude_none=True) for t in tools] if native else None
    return engine.render(out, tools=wire_tools)


def _json_arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise APIError(400, "a tool call's arguments are not valid JSON", param="messages") from None
