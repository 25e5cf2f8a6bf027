"""Issue 30, item 3: the non-strict JSON modes are enforced by the grammar.

``json_object`` is held to a JSON object and a ``json_schema`` without
``strict`` to its schema, on the random model whose unconstrained output is
not JSON; a schema llguidance cannot compile is generated unconstrained and
marked downgraded (strict: still the 400); ``enforce_json_modes=False`` keeps
the old sanitize-only behaviour."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from afm_core._engine.engine import open_engine
from afm_core._engine.grammar import GrammarError
from afm_core.api.chat_request import ChatRequest

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "ok": {"type": "boolean"}},
        "required": ["city", "ok"], "additionalProperties": False}
# an external $ref: llguidance cannot compile it
UNCOMPILABLE = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}, "required": ["a"]}


def req(rf: dict[str, Any], seed: int, **kw: Any) -> ChatRequest:
    return ChatRequest.from_openai({"messages": [{"role": "user", "content": "answer in JSON"}],
                                    "response_format": rf, "temperature": 1.0, "seed": seed,
                                    "max_tokens": 48, "enable_thinking": False, **kw})


def schema_rf(schema: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
    js: dict[str, Any] = {"name": "r", "schema": schema}
    if strict is not None:
        js["strict"] = strict
    return {"type": "json_schema", "json_schema": js}


async def complete(engine: Any, r: ChatRequest) -> tuple[str, bool]:
    async with engine.stream(r) as s:
        c = await s.collect()
        return c["choices"][0]["message"]["content"], s.grammar_downgraded


def parses(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


async def test_json_schema_without_strict_is_enforced(random_model_dir: Path) -> None:
    async with open_engine(random_model_dir, warmup=False) as engine:
        for seed in range(3):
            for strict in (None, False):
                text, downgraded = await complete(engine, req(schema_rf(CITY, strict), seed))
                value = parses(text)
                assert not downgraded
                assert isinstance(value, dict) and value["city"] in ("Paris", "Oslo"), text
                assert isinstance(value["ok"], bool) and set(value) == {"city", "ok"}
    async with open_engine(random_model_dir, warmup=False, enforce_json_modes=False) as engine:
        texts = [(await complete(engine, req(schema_rf(CITY), seed)))[0] for seed in range(3)]
        assert not any(isinstance(parses(t), dict) for t in texts), texts  # the random model's prose


async def test_json_object_is_enforced(random_model_dir: Path) -> None:
    rf = {"type": "json_object"}
    async with open_engine(random_model_dir, warmup=False) as engine:
        rbrace = engine._tokenizer.encode("}", add_special_tokens=False)[0]
        for seed in range(3):
            # a bias towards "}" closes the object the random model would otherwise keep writing
            text, downgraded = await complete(engine, req(rf, seed, logit_bias={str(rbrace): 6.0},
                                                          max_tokens=200))
            assert not downgraded
            assert isinstance(parses(text), dict), text
    async with open_engine(random_model_dir, warmup=False, enforce_json_modes=False) as engine:
        texts = [(await complete(engine, req(rf, seed)))[0] for seed in range(3)]
        assert not any(isinstance(parses(t), dict) for t in texts), texts


async def test_uncompilable_schema_is_downgraded_unless_strict(random_model_dir: Path) -> None:
    async with open_engine(random_model_dir, warmup=False) as engine:
        text, downgraded = await complete(engine, req(schema_rf(UNCOMPILABLE), 0, max_tokens=4))
        assert downgraded and isinstance(text, str)
        with pytest.raises(GrammarError) as info:
            await complete(engine, req(schema_rf(UNCOMPILABLE, strict=True), 0, max_tokens=4))
        assert info.value.status == 400 and info.value.param == "response_format"
        # a loose schema beside forced tool calls: the call comes, nothing is marked
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        _, downgraded = await complete(engine, req(schema_rf(CITY), 0, tools=tools, tool_choice="required",
                                                   max_tokens=4))
        assert not downgraded
    async with open_engine(random_model_dir, warmup=False, enforce_json_modes=False) as engine:
        _, downgraded = await complete(engine, req(schema_rf(UNCOMPILABLE), 0, max_tokens=4))
        assert not downgraded  # sanitize-only, as asked: nothing was to be enforced
