"""A served model's own sampling defaults (an Ollama model's ``params`` layer)
fill the fields a request leaves out, on every generation API; the request's
own values win.  The echo model answers the last user message, so a default
stop string shows in the answer."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai

from afm_http._registry import ModelSpec
from afm_http.testing import running_models

ASK = [{"role": "user", "content": "hello world"}]


async def test_defaults_fill_what_requests_leave_out(echo_model_dir: Path) -> None:
    spec = ModelSpec("echo", str(echo_model_dir), defaults=(("stop", ("wor",)), ("temperature", 0.0)))
    async with running_models([spec], warmup=False) as (url, registry), \
            httpx.AsyncClient(base_url=url, timeout=60) as h:
        assert registry.defaults_for("echo") == {"stop": ("wor",), "temperature": 0.0}
        oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = await oai.chat.completions.create(model="echo", messages=ASK)  # type: ignore[arg-type]
        assert out.choices[0].message.content == "hello " and out.choices[0].finish_reason == "stop"
        out = await oai.chat.completions.create(model="echo", messages=ASK, stop=["zzz"])  # type: ignore[arg-type]
        assert out.choices[0].message.content == "hello world"  # the request's own stop wins
        r = await oai.responses.create(model="echo", input="hello world")
        assert r.temperature == 0.0 and r.output_text == "hello world"  # (Responses have no stop field)
        r = await oai.responses.create(model="echo", input="hello world", temperature=0.5)
        assert r.temperature == 0.5
        ant = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        msg = await ant.messages.create(model="echo", max_tokens=50, messages=ASK)  # type: ignore[arg-type]
        assert msg.content[0].text == "hello " and msg.stop_reason == "stop_sequence"  # type: ignore[union-attr]
        assert msg.stop_sequence == "wor"
        resp = await h.post("/api/chat", json={"model": "echo", "messages": ASK, "stream": False})
        assert resp.json()["message"]["content"] == "hello "
        resp = await h.post("/api/chat", json={"model": "echo", "messages": ASK, "stream": False,
                                               "options": {"stop": ["zzz"]}})
        assert resp.json()["message"]["content"] == "hello world"
        # the tokenizer routes take no sampling fields: nothing is added there
        resp = await h.post("/tokenize", json={"content": "hello"})
        assert resp.status_code == 200
        await oai.close()
        await ant.close()
