"""Chat templates: what they read, the tool-call format detected from them, and
afm's tool prompt for templates that cannot render tools."""

from __future__ import annotations

import json
from typing import Any

import jinja2
import pytest

from afm_core._models.loader import tool_format_for
from afm_core._models.templates import polyfill_tool_messages, template_features, tool_prompt
from afm_core.testing._tokenizer import chat_template as qwen_like_template

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
# Gemma 3's template refuses nothing but knows no tools; Gemma 2's refuses a system role.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% set role = 'model' if message['role'] "
    "== 'assistant' else message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] "
    "| trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}"
    "{% endif %}"
)
# The markers of the real templates, inside templates that read ``tools``.
LLAMA31 = ("{%- if tools %}{{ tools | tojson }}{% endif %}{%- for m in messages %}{%- if m.role == 'ipython' %}"
           "<|start_header_id|>ipython<|end_header_id|>{% endif %}{%- if m.tool_calls %}"
           '{"name": "{{ m.tool_calls[0].function.name }}", "parameters": {}}<|eot_id|>{% endif %}{% endfor %}')
MISTRAL = ("{%- for m in messages %}{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}"
           "[/AVAILABLE_TOOLS]{% endif %}{%- if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls|tojson }}"
           "{% endif %}{% endfor %}")
QWEN3_CODER = ("{%- if tools %}<tools>{% for t in tools %}<function><name>{{ t.function.name }}</name>"
               "</function>{% endfor %}</tools>If you choose to call a function ONLY reply in the following "
               "format:\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
               "\nvalue_1\n</parameter>\n</function>\n</tool_call>{% endif %}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize(("template", "vocab", "expected"), [
    (qwen_like_template(), (), ("hermes", True)),  # Qwen2.5: <tool_call> JSON
    (QWEN3_CODER, (), ("qwen3_coder", True)),
    (LLAMA31, ("<|python_tag|>", "<|eot_id|>"), ("llama3_json", True)),
    (LLAMA31.replace("ipython", "tool"), ("<|python_tag|>",), ("llama3_json", True)),  # Llama 3.2: vocab
    (MISTRAL, ("[TOOL_CALLS]",), ("mistral", True)),
    (SMOLLM2, (), ("hermes", False)),  # tools rendered by afm, parsed as Hermes
    (GEMMA2, ("<start_of_turn>",), ("hermes", False)),
    ("{{ messages | tojson }}{{ tools | tojson }}", (), (None, True)),  # reads tools, unknown format
    ("", (), (None, False)),  # a base model: no chat
])  # fmt: skip
def test_tool_format_detection(template: str, vocab: tuple[str, ...], expected: tuple[Any, bool]) -> None:
    assert tool_format_for(template, vocab) == expected


def test_template_features() -> None:
    assert template_features(SMOLLM2).tools is False
    assert template_features(SMOLLM2).tool_calls is False
    qwen = template_features(qwen_like_template())
    assert qwen.tools and qwen.tool_calls
    assert template_features("{{ m['tool_calls'] }}").tool_calls
    assert template_features("{% if %}").tools  # unparsable: trusted, its error shows when it renders


def _render(template: str, messages: list[dict[str, Any]]) -> str:
    env = jinja2.Environment()
    env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(jinja2.TemplateError(msg))
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="<bos>")


def test_tool_prompt_lists_tools_and_the_call_format() -> None:
    text = tool_prompt(TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert "must" not in text
    assert "You must call at least one function" in tool_prompt(TOOLS, "required")
    named = tool_prompt(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False)
    assert "You must call the function 'get_weather'" in named and "at most one function" in named


def test_polyfill_system_prompt_placement() -> None:
    user = [{"role": "user", "content": "weather?"}]
    out = polyfill_tool_messages(user, TOOLS)
    assert out[0]["role"] == "system" and out[0]["content"] == tool_prompt(TOOLS) and out[1:] == user
    out = polyfill_tool_messages([{"role": "system", "content": "Be brief."}, *user], TOOLS)
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and len(out) == 2
    out = polyfill_tool_messages(user, TOOLS, system_role=False)
    assert len(out) == 1 and out[0]["content"].startswith("# Tools") and out[0]["content"].endswith("\n\nweather?")
    assert user == [{"role": "user", "content": "weather?"}]  # the request's messages are not changed
    rendered = _render(GEMMA2, out)
    assert "<start_of_turn>user\n# Tools" in rendered and rendered.endswith("<start_of_turn>model\n")


def test_polyfill_history_renders_on_a_template_without_tools() -> None:
    history = [
        {"role": "user", "content": "two cities"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "cold"},
        {"role": "tool", "tool_call_id": "b", "content": "warm"},
    ]
    with pytest.raises(TypeError):  # SmolLM2's template alone cannot concatenate a call-only message
        _render(SMOLLM2, history)
    out = polyfill_tool_messages(history, None)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[1]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                                 '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>')
    assert out[2]["content"] == "<tool_response>\ncold\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
    text = _render(SMOLLM2, out)
    assert text.endswith("<|im_start|>user\n<tool_response>\ncold\n</tool_response>\n<tool_response>\nwarm\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
