"""Tools on a model whose chat template cannot render them (SmolLM2's), and a
model without a chat template at all (a base model).

afm renders the tools itself (``afm_core/_models/templates.py``) and parses
Hermes-style calls back: the prompt grows with the tools on every API that
takes them (count_tokens and usage say so), earlier calls and tool results
render, and a ``<tool_call>`` the model writes streams as a tool call through
the ``openai`` and ``anthropic`` SDKs.  A model with no template refuses chat
with a 400 that points at ``/v1/completions``, which works.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from afm_http.testing import running_server

# SmolLM2-135M-Instruct's template (from its GGUF): no tools, no tool_calls.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool number {i}.",
                                           "parameters": {"type": "object", "properties": {
                                               "x": {"type": "integer"}}}}}
         for i in range(25)]  # fmt: skip
CALL = 'Sure.<tool_call>\n{"name": "tool_3", "arguments": {"x": 7}}\n</tool_call>'


def _with_template(src: Path, dst: Path, template: str | None) -> Path:
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    path.write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def smollm_like(echo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_template(echo_model_dir, tmp_path_factory.mktemp("notools") / "m", SMOLLM2_TEMPLATE)


def _anthropic_tools() -> list[dict[str, Any]]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip


async def test_tools_are_rendered_and_counted(smollm_like: Path) -> None:
    async with running_server(smollm_like) as (url, engine):
        client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        plain = (await client.messages.count_tokens(**kw)).input_tokens
        with_tools = (await client.messages.count_tokens(**kw, tools=_anthropic_tools())).input_tokens
        assert with_tools > plain + 25 * 10
        await client.close()
        ids = await engine.tokenize_chat({"messages": kw["messages"], "tools": TOOLS})
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/detokenize", json={"tokens": ids})
            prompt = r.json()["content"]
        assert "<tools>" in prompt and '"name": "tool_24"' in prompt and "<tool_call>" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")
        none = await engine.tokenize_chat({"messages": kw["messages"], "tools": TOOLS, "tool_choice": "none"})
        assert len(none) == plain


async def test_tool_calls_stream_through_every_api(smollm_like: Path) -> None:
    async with running_server(smollm_like) as (url, _):
        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": CALL}]
        resp = await oa.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] \
            == [("tool_3", {"x": 7})]
        async with oa.chat.completions.stream(model="m", messages=messages, tools=TOOLS) as s:
            async for _ in s:
                pass
            final = await s.get_final_completion()
        assert final.choices[0].message.tool_calls[0].function.name == "tool_3"
        # without tools nothing is parsed: the markup is the answer
        resp = await oa.chat.completions.create(model="m", messages=messages)
        assert resp.choices[0].message.content == CALL and not resp.choices[0].message.tool_calls

        responses_tools: list[Any] = [{"type": "function", "name": t["function"]["name"],
                                       "parameters": t["function"]["parameters"]} for t in TOOLS]
        out = await oa.responses.create(model="m", input=CALL, tools=responses_tools)
        calls = [o for o in out.output if o.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("tool_3", {"x": 7})]
        await oa.close()

        an = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        async with an.messages.stream(model="m", max_tokens=200, tools=_anthropic_tools(),
                                      messages=[{"role": "user", "content": CALL}]) as st:
            message = await st.get_final_message()
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and [(u.name, u.input) for u in uses] == [("tool_3", {"x": 7})]
        await an.close()


async def test_tool_history_renders_on_a_template_without_tools(smollm_like: Path) -> None:
    history: list[Any] = [
        {"role": "user", "content": "use a tool"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "tool_1", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "user", "content": "thanks"},
    ]
    async with running_server(smollm_like) as (url, engine):
        ids = await engine.tokenize_chat({"messages": history, "tools": TOOLS[:2]})
        async with httpx.AsyncClient(base_url=url) as c:
            prompt = (await c.post("/detokenize", json={"tokens": ids})).json()["content"]
        assert '<tool_call>\n{"name": "tool_1", "arguments": {"x": 1}}\n</tool_call>' in prompt
        assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in prompt
        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        resp = await oa.chat.completions.create(model="m", messages=history)  # no tools: history still renders
        assert resp.choices[0].message.content == "thanks"
        await oa.close()


async def test_a_model_without_a_template_refuses_chat(echo_model_dir: Path, tmp_path: Path) -> None:
    base = _with_template(echo_model_dir, tmp_path / "base", None)
    async with running_server(base) as (url, _):
        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert "has no chat template" in info.value.message and "/v1/completions" in info.value.message
        done = await oa.completions.create(model="m", prompt="Once upon a time", max_tokens=3)
        assert done.choices[0].finish_reason in ("length", "stop")
        await oa.close()
        an = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="no chat template"):
            await an.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}])
        await an.close()
