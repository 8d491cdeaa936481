"""Chat template rendering, compared with transformers' `apply_chat_template` on the same templates."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from edgellm.errors import EdgeLLMError
from edgellm.runtime import chat_template
from edgellm.runtime.chat_template import ChatTemplateError, render_chat

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5-style tool section: tojson with HF's options, loop controls, namespace, whitespace control.
TOOLS_TEMPLATE = """{{ bos_token }}
{%- if tools %}
<|im_start|>system
You may call functions:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>
Pretty: {{ tools[0] | tojson(indent=2) }}<|im_end|>
{% endif %}
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message.role == 'tool' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
<|im_start|>{{ message.role }}
{% if message.content is defined %}{{ message.content }}{% endif %}
{% if message.tool_calls is defined %}
{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}
{% endif %}
{% generation %}<|im_end|>{% endgeneration %}
{% endfor %}
{{ ns.count }} messages{{ eos_token }}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo d'une ville — 天气 <b>&</b>",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🐔 为什么"},
    ],
    [{"role": "user", "content": "  leading and trailing whitespace \n\n"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    backend = HFTokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def hf_render(tok: PreTrainedTokenizerFast, template: str, messages: list[dict], **kwargs: Any) -> str:
    tok.chat_template = template
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_smollm2_template_matches_transformers(
    hf_tokenizer: PreTrainedTokenizerFast, index: int, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[index]
    ours = render_chat(SMOLLM2, messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_render(hf_tokenizer, SMOLLM2, messages, add_generation_prompt=add_generation_prompt)


def test_smollm2_template_exact_text() -> None:
    assert render_chat(SMOLLM2, [{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_list_of_text_parts_renders_like_the_joined_string(hf_tokenizer: PreTrainedTokenizerFast) -> None:
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second."}]},
    ]
    joined = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "First part.\nSecond."}]
    assert render_chat(SMOLLM2, parts) == hf_render(hf_tokenizer, SMOLLM2, joined, add_generation_prompt=True)
    assert parts[1]["content"][0] == {"type": "text", "text": "First part."}, "caller's messages are not modified"


def test_non_text_parts_are_refused() -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ChatTemplateError, match="message 0: content part of type 'image_url' is not supported"):
        render_chat(SMOLLM2, messages)


@pytest.mark.parametrize("with_tools", [True, False])
def test_tools_tojson_namespace_and_generation_tag_match_transformers(
    hf_tokenizer: PreTrainedTokenizerFast, with_tools: bool
) -> None:
    messages = [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,  # dropped, as transformers does, so `is defined` is false
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    tools = TOOLS if with_tools else None
    ours = render_chat(TOOLS_TEMPLATE, messages, tools=tools, bos_token="<s>", eos_token="</s>")
    ref = hf_render(hf_tokenizer, TOOLS_TEMPLATE, messages, tools=tools, add_generation_prompt=True)
    assert ours == ref
    if with_tools:
        assert json.dumps(TOOLS[0], ensure_ascii=False) in ours  # no HTML escaping, no \u escapes
        assert json.dumps(TOOLS[0], ensure_ascii=False, indent=2) in ours
    assert "3 messages</s>" in ours


def test_extra_variables_and_strftime_now() -> None:
    template = "{{ strftime_now('%Y-%m-%d') }}|{{ enable_thinking }}|{{ data | tojson(sort_keys=True) }}"
    before = datetime.now().strftime("%Y-%m-%d")
    out = render_chat(template, [], enable_thinking=False, data={"b": 1, "a": [1, 2]})
    after = datetime.now().strftime("%Y-%m-%d")
    assert out in {f"{day}|False|" + '{"a": [1, 2], "b": 1}' for day in (before, after)}


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages[0]['__class__'] }}",
        "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
        "{{ messages.append(1) }}",
    ],
)
def test_sandbox_refuses_python_internals(template: str) -> None:
    with pytest.raises(ChatTemplateError, match="unsafe") as info:
        render_chat(template, [{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)


def test_raise_exception_is_a_one_line_error() -> None:
    template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported!\nSorry.') }}{% endif %}{% endfor %}"
    )
    assert render_chat(template, [{"role": "user", "content": "x"}]) == ""
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, [{"role": "system", "content": "x"}])
    assert str(info.value) == "chat template refused the conversation: Only user and assistant roles are supported! Sorry."
    assert isinstance(info.value, EdgeLLMError)


@pytest.mark.parametrize(
    "template,messages,expected",
    [
        ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", [], "chat template syntax error at line 2: "),
        ("{{ messages | no_such_filter }}", [], "chat template syntax error at line 1: No filter named"),
        ("{{ messages[0].content + 1 }}", [{"role": "user", "content": "x"}], "chat template failed: TypeError: "),
        ("{{ 1 / 0 }}", [], "chat template failed: ZeroDivisionError: "),
        ("{{ undefined_thing.attr }}", [], "chat template failed: UndefinedError: 'undefined_thing' is undefined"),
    ],
)
def test_template_errors_are_one_line(template: str, messages: list, expected: str) -> None:
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, messages)
    assert str(info.value).startswith(expected)
    assert "\n" not in str(info.value)


def test_templates_are_compiled_once() -> None:
    chat_template._compile.cache_clear()
    messages = [{"role": "user", "content": "Hi"}]
    for _ in range(5):
        render_chat(SMOLLM2, messages)
    render_chat(SMOLLM2 + " ", messages)
    info = chat_template._compile.cache_info()
    assert (info.misses, info.hits) == (2, 4)


TOOL_CONVERSATION = [
    {"role": "system", "content": "You call tools when they help."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
    {"role": "tool", "content": "{\"temperature\": 18}"},
    {"role": "user", "content": "And in Lyon?"},
]


@pytest.mark.parametrize("messages", [TOOL_CONVERSATION[1:2], TOOL_CONVERSATION], ids=["ask", "after-a-call"])
def test_qwen_gguf_template_with_tools_matches_transformers(
    hf_tokenizer: PreTrainedTokenizerFast, qwen_gguf: Path, messages: list[dict]
) -> None:
    """Qwen2.5's own template (from its GGUF) with `tools`: the tool signatures in <tools>, an assistant tool
    call rendered as <tool_call>, a tool reply as <tool_response> — as transformers renders the same template."""
    import gguf

    field = gguf.GGUFReader(qwen_gguf).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    ours = render_chat(template, messages, tools=TOOLS, add_generation_prompt=True)
    assert ours == hf_render(hf_tokenizer, template, messages, tools=TOOLS, add_generation_prompt=True)
    assert "<tools>" in ours and '"name": "get_weather"' in ours
    if len(messages) > 2:
        assert "<tool_call>" in ours and "<tool_response>" in ours
