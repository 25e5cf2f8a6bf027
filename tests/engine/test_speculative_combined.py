"""Speculative decoding together with the engine's other features: logits
processors (grammar, penalties, ``logit_bias``), sampled rows, LoRA adapters
and the quantized KV cache.  Greedy output is the same tokens as without
speculation; seeded sampled output is the same again for the same seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from afm_core._engine.engine import Engine, open_engine
from tests.engine.test_lora import adapters, prompts, served, tokens  # noqa: F401  (adapters: a fixture)
from tests.engine.test_speculative import PROMPTS, req, token_ids

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "ok": {"type": "boolean"}},
        "required": ["city", "ok"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
RF = {"type": "json_schema", "json_schema": {"name": "r", "schema": CITY, "strict": True}}

ANSWER = '{"city": "Oslo", "ok": true}'
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "ok": false}}\n</tool_call>'
TEXTS = [f"{ANSWER} and {CALL} then {ANSWER} or {CALL}", *PROMPTS[:2]]
"""Prompts holding the constrained answers: prompt lookup guesses them, the grammar allows them."""

CASES: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": RF},
    "tool_required": {"tools": TOOLS, "tool_choice": "required"},
    "penalties": {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                  "logit_bias": {"17": 5.0, "42": -3.0}},
}


def spec_settings(kind: str, model_dir: Path) -> dict[str, Any]:
    # the model as its own draft: guesses its own unconstrained greedy text, which
    # processors make right at some positions and wrong (or forbidden) at others
    return {"prompt_lookup": 3} if kind == "lookup" else {"draft_model": str(model_dir), "draft_tokens": 3}


async def outputs(engine: Engine, case: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{}] * 3

    async def one(i: int) -> None:
        r = await engine.complete(req(TEXTS[i], max_tokens=48, enable_thinking=False, **case, **kw))
        choice = r["choices"][0]
        message = dict(choice["message"])
        if message.get("tool_calls"):  # their ids are random
            message["tool_calls"] = [c["function"] for c in message["tool_calls"]]
        results[i] = {"message": message, "finish": choice["finish_reason"]}

    for i in range(len(results)):  # one at a time: each speculates alone
        await one(i)
    return results


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["lookup", "draft"])
async def test_greedy_with_processors_is_the_same_with_speculation(
        case: str, kind: str, random_model_dir: Path) -> None:
    async with open_engine(random_model_dir, warmup=False, spec_max_batch=0) as engine:
        plain = await outputs(engine, CASES[case])
    async with open_engine(random_model_dir, warmup=False, **spec_settings(kind, random_model_dir)) as engine:
        spec = await outputs(engine, CASES[case])
        stats = engine.statistics()
    assert spec == plain
    if case == "json_schema":
        for r in spec:
            assert set(json.loads(r["message"]["content"])) == {"city", "ok"}
    if case == "tool_required":
        assert all(r["finish"] == "tool_calls" for r in spec)
    # the random draft's free text is rarely what a grammar allows (its guesses are cut to
    # nothing); the prompt's JSON is
    if kind == "lookup" or case == "penalties":
        assert stats.spec_proposed > 0 and stats.spec_accepted > 0


async def test_grammar_on_the_echo_model_accepts_its_guesses(tmp_path: Path) -> None:
    """The echo repeats its prompt; asked for JSON it must leave it, so its
    guesses are right until the grammar cuts them, then again once it copies."""
    from afm_core.testing import make_echo_model

    echo = make_echo_model(tmp_path / "echo", all_positions=True)
    text = '{"city": "Oslo", "ok": true} {"city": "Oslo", "ok": true}'
    async with open_engine(echo, warmup=False, spec_max_batch=0) as engine:
        plain = await engine.complete(req(text, max_tokens=30, response_format=RF, enable_thinking=False))
    async with open_engine(echo, warmup=False, prompt_lookup=4) as engine:
        spec = await engine.complete(req(text, max_tokens=30, response_format=RF, enable_thinking=False))
        assert engine.statistics().spec_accepted > 0
    assert spec["choices"][0]["message"] == plain["choices"][0]["message"]
    json.loads(spec["choices"][0]["message"]["content"])


async def test_seeded_sampled_rows_with_a_grammar_repeat(random_model_dir: Path) -> None:
    settings = spec_settings("lookup", random_model_dir)
    runs = []
    for _ in range(2):
        async with open_engine(random_model_dir, warmup=False, spec_max_batch=4, **settings) as engine:
            runs.append(await outputs(engine, {"response_format": RF, "temperature": 0.9, "seed": 11}))
            assert engine.statistics().spec_proposed > 0
    assert runs[0] == runs[1]
    for r in runs[0]:
        assert set(json.loads(r["message"]["content"])) == {"city", "ok"}


async def test_adapters_with_speculation(random_model_dir: Path, adapters: dict[str, Path]) -> None:  # noqa: F811
    ids = prompts()[1]
    order = [None, "fox", "zebra", "fox"]

    async def all_of(engine: Engine) -> tuple[dict[str | None, str], dict[int, str]]:
        alone = {name: (await tokens(engine, ids, 24, **({"adapters": name} if name else {})))[0]
                 for name in ("fox", "zebra", None)}
        together: dict[int, str] = {}

        async def one(i: int, name: str | None) -> None:
            together[i] = (await tokens(engine, ids, 24, **({"adapters": name} if name else {})))[0]

        async with trio.open_nursery() as nursery:
            for i, name in enumerate(order):
                nursery.start_soon(one, i, name)
        return alone, together

    async with open_engine(random_model_dir, warmup=False, prefix_cache_bytes=0, adapters=served(adapters),
                           spec_max_batch=0) as engine:
        plain = await all_of(engine)
    async with open_engine(random_model_dir, warmup=False, prefix_cache_bytes=0, adapters=served(adapters),
                           spec_max_batch=4, draft_model=str(random_model_dir), draft_tokens=3) as engine:
        spec = await all_of(engine)
        assert engine.statistics().spec_accepted > 0
    assert len(set(plain[0].values())) == 3  # the adapters change the output
    assert spec == plain


@pytest.fixture(scope="module")
def kv_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from afm_core.testing import make_random_model

    # heads of 64: a multiple of the quantized cache's group
    return make_random_model(tmp_path_factory.mktemp("kv"), hidden_size=256, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("kind", ["lookup", "draft"])
async def test_quantized_cache_with_speculation(kind: str, kv_model_dir: Path) -> None:
    lengths = [7, 31, 16, 45]
    async with open_engine(kv_model_dir, warmup=False, kv_bits=8, spec_max_batch=0) as engine:
        plain = await token_ids(engine, PROMPTS, lengths)
    async with open_engine(kv_model_dir, warmup=False, kv_bits=8, spec_max_batch=4,
                           **spec_settings(kind, kv_model_dir)) as engine:
        spec = await token_ids(engine, PROMPTS, lengths)
        assert engine.statistics().spec_steps > 0
    assert spec == plain


@pytest.mark.parametrize("model", ["random", "echo"])
async def test_logprobs_rows_speculate(model: str, random_model_dir: Path, tmp_path: Path) -> None:
    """A row reading log-probabilities speculates: each accepted token's come
    from its position of the verify pass (equal to a plain step's to float
    rounding), with the same tokens."""
    from afm_core.testing import make_echo_model

    path = random_model_dir if model == "random" else make_echo_model(tmp_path / "echo", all_positions=True)
    text = PROMPTS[0] if model == "random" else " ".join(["lorem ipsum dolor sit amet"] * 6)
    # the random model as its own draft: every guess right; the echo's lookups: mostly right
    spec_kw = spec_settings("draft", path) if model == "random" else {"prompt_lookup": 4}
    r = req(text, max_tokens=30, logprobs=True, top_logprobs=3, enable_thinking=False)
    async with open_engine(path, warmup=False, spec_max_batch=0) as engine:
        plain = await engine.complete(r)
    async with open_engine(path, warmup=False, **spec_kw) as engine:
        spec = await engine.complete(r)
        stats = engine.statistics()
    assert stats.spec_accepted > 0
    assert spec["choices"][0]["message"] == plain["choices"][0]["message"]
    got, want = spec["choices"][0]["logprobs"]["content"], plain["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in got] == [t["token"] for t in want] and len(got) > 5
    assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in want], abs=1e-4)
    assert [x["token"] for t in got for x in t["top_logprobs"]] == \
        [x["token"] for t in want for x in t["top_logprobs"]]
    assert [x["logprob"] for t in got for x in t["top_logprobs"]] == \
        pytest.approx([x["logprob"] for t in want for x in t["top_logprobs"]], abs=1e-4)
