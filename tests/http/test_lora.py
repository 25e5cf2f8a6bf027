"""LoRA adapters over HTTP: ``model: "base:name"`` and mlx_lm.server's ``adapters``
through the openai SDK on a real hypercorn server, the 404 of an unknown adapter,
``/v1/models`` listing the adapters, ``afm serve --adapter``."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import openai
import pytest

from afm_core import ChatRequest, Engine
from afm_http._registry import ModelSpec
from afm_http._serve_cli import _model_specs, add_arguments
from afm_http.testing import running_models, running_server
from tests.engine.test_lora import adapters, served  # noqa: F401  (the module's adapter fixture)

MESSAGES = [{"role": "user", "content": "Tell me about tea."}]


async def direct(engine: Engine, adapter: str | None) -> str:
    """The engine's own answer, greedy, for the same chat."""
    got = await engine.complete(ChatRequest(messages=tuple(MESSAGES), temperature=0.0, max_tokens=12,
                                            adapter=adapter))
    return str(got["choices"][0]["message"]["content"])


async def test_openai_sdk_picks_adapters_by_model_and_by_field(random_model_dir: Path,
                                                               adapters: dict[str, Path]) -> None:  # noqa: F811
    async with running_server(random_model_dir, adapters=served(adapters)) as (url, engine):
        base = engine.model_id
        want = {name: await direct(engine, name) for name in (None, "fox", "zebra")}
        assert len(set(want.values())) == 3
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        kw = {"messages": MESSAGES, "temperature": 0, "max_tokens": 12}
        for model, extra, name in ((base, None, None), (f"{base}:fox", None, "fox"),
                                   (base, {"adapters": "zebra"}, "zebra"), (f"{base}:zebra", None, "zebra")):
            got = await client.chat.completions.create(model=model, extra_body=extra, **kw)  # type: ignore[call-overload]
            assert got.choices[0].message.content == want[name], (model, extra)
            assert got.model == model
        # streamed: the same text
        stream = await client.chat.completions.create(model=f"{base}:fox", stream=True, **kw)  # type: ignore[call-overload]
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(parts) == want["fox"]
        # raw completions take them too
        a = await client.completions.create(model=f"{base}:fox", prompt="abc", max_tokens=8, temperature=0)
        b = await client.completions.create(model=base, prompt="abc", max_tokens=8, temperature=0,
                                            extra_body={"adapters": "fox"})
        c = await client.completions.create(model=base, prompt="abc", max_tokens=8, temperature=0)
        assert a.choices[0].text == b.choices[0].text != c.choices[0].text
        for model, extra in ((f"{base}:nope", None), (base, {"adapters": "nope"})):
            with pytest.raises(openai.NotFoundError) as info:
                await client.chat.completions.create(model=model, extra_body=extra, **kw)  # type: ignore[call-overload]
            assert info.value.code == "adapter_not_found"
        listed = await client.models.list()
        ids = [m.id for m in listed.data]
        assert ids == [base, f"{base}:fox", f"{base}:zebra"]
        card = await client.models.retrieve(f"{base}:fox")
        assert card.model_extra is not None and card.model_extra["parent"] == base
        async with httpx.AsyncClient(base_url=url) as h:
            # Anthropic's Messages route reads the same model field
            r = await h.post("/v1/messages", json={"model": f"{base}:fox", "max_tokens": 12, "temperature": 0,
                                                   "messages": MESSAGES})
            assert r.status_code == 200 and r.json()["content"][0]["text"] == want["fox"]
            r = await h.post("/v1/messages", json={"model": f"{base}:nope", "max_tokens": 12,
                                                   "messages": MESSAGES})
            assert r.status_code == 404


async def test_several_models_route_base_and_adapter(random_model_dir: Path, echo_model_dir: Path,
                                                     adapters: dict[str, Path]) -> None:  # noqa: F811
    specs = [ModelSpec("tiny", str(random_model_dir), adapters=served(adapters)),
             ModelSpec("echo", str(echo_model_dir))]
    async with running_models(specs) as (url, registry), httpx.AsyncClient(base_url=url) as c:
        ids = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
        assert ids == ["tiny", "tiny:fox", "tiny:zebra", "echo"]
        body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 12}
        r = await c.post("/v1/chat/completions", json={**body, "model": "tiny:zebra"})
        assert r.status_code == 200 and r.json()["model"] == "tiny:zebra"
        engine = registry.engine_of("tiny")
        assert engine is not None and engine.adapters == ("fox", "zebra")
        assert r.json()["choices"][0]["message"]["content"] == await direct(engine, "zebra")
        r = await c.post("/v1/chat/completions", json={**body, "model": "echo:fox"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
        r = await c.post("/v1/chat/completions", json={**body, "model": "nope:fox"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def expanded(path: str) -> str:
    return str(Path(path).expanduser())


async def test_afm_serve_adapter_flags(random_model_dir: Path, echo_model_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    home = expanded("~/b")
    args = parser.parse_args(["--model", str(random_model_dir), "--model", str(echo_model_dir),
                              "--adapter", "a=/x/a", "--adapter", f"{echo_model_dir.name}:b=~/b"])
    specs = await _model_specs(args)
    assert specs[0].adapters == (("a", "/x/a"),)
    assert specs[1].adapters == (("b", home),)
    with pytest.raises(SystemExit):
        parser.parse_args(["--adapter", "no-path"])
    args = parser.parse_args(["--model", str(random_model_dir), "--adapter", "other:a=/x"])
    with pytest.raises(Exception, match="no served model"):
        await _model_specs(args)
