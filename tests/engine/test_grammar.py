"""Grammar-constrained output: the Lark grammars themselves (llguidance on the
test tokenizer), then the engine enforcing them on the echo and random models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from afm_core._engine.engine import open_engine
from afm_core._engine.grammar import OutputShape, call_schemas, grammar_processor, output_grammar
from afm_core.api.chat_request import ChatRequest

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
X_INT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
         "additionalProperties": False}


def tool(name: str, params: dict[str, Any], strict: bool = False) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "parameters": params}
    if strict:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def call(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(random_model_dir: Path) -> Any:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(random_model_dir)


def accepts(tokenizer: Any, shape: OutputShape, text: str) -> bool:
    """Whether the grammar of ``shape`` takes ``text`` (its tokens) as a whole turn."""
    m = grammar_processor(output_grammar(shape), tokenizer, 0).matcher
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


# -- the grammars ------------------------------------------------------------------

def test_auto_with_strict_tools_takes_text_or_valid_calls(tokenizer: Any) -> None:
    tools = [tool("f", X_INT, strict=True), tool("g", CITY)]
    shape = OutputShape(content="text", calls=call_schemas(tools, "auto", strict_only=True))
    assert accepts(tokenizer, shape, "Just an answer, no call.")
    assert accepts(tokenizer, shape, "")
    assert accepts(tokenizer, shape, "Let me check.\n\n" + call("f", {"x": 3}))
    assert accepts(tokenizer, shape, call("f", {"x": 3}) + "\n" + call("g", {"anything": [1]}))
    assert not accepts(tokenizer, shape, call("f", {"x": "three"}))  # strict: schema applies
    assert not accepts(tokenizer, shape, call("f", {"x": 3, "y": 4}))
    assert not accepts(tokenizer, shape, call("h", {}))  # unknown tool
    assert not accepts(tokenizer, shape, call("f", {"x": 3}) + " and text after")


def test_required_and_named_allow_only_calls(tokenizer: Any) -> None:
    tools = [tool("f", X_INT), tool("g", CITY)]
    required = OutputShape(content=None, calls=call_schemas(tools, "required", strict_only=False))
    assert accepts(tokenizer, required, call("g", {"city": "Oslo"}))
    assert not accepts(tokenizer, required, call("g", {"city": "Rome"}))  # schema applies, strict or not
    assert not accepts(tokenizer, required, "No.")
    assert not accepts(tokenizer, required, "")
    single = OutputShape(content=None, calls=required.calls, parallel=False)
    two = call("f", {"x": 1}) + "\n" + call("g", {"city": "Paris"})
    assert accepts(tokenizer, required, two) and not accepts(tokenizer, single, two)
    named = OutputShape(content=None, calls=call_schemas(tools, {"function": {"name": "g"}},
                                                         strict_only=False))
    assert accepts(tokenizer, named, call("g", {"city": "Paris"}))
    assert not accepts(tokenizer, named, call("f", {"x": 1}))


def test_reasoning_block_stays_free(tokenizer: Any) -> None:
    calls = call_schemas([tool("f", X_INT)], "required", strict_only=False)
    optional = OutputShape(content=None, calls=calls, think="optional")
    assert accepts(tokenizer, optional, "<think>Which tool? f.</think>\n\n" + call("f", {"x": 1}))
    assert accepts(tokenizer, optional, call("f", {"x": 1}))
    assert not accepts(tokenizer, optional, "<think>hmm</think>\n\nno call")
    started = OutputShape(content={"type": "integer"}, think="started")
    assert accepts(tokenizer, started, "thinking it over</think>\n\n42")
    assert not accepts(tokenizer, started, "42")  # the prompt opened the block: it must close
    text = OutputShape(content="text", calls=calls, think="optional")
    assert accepts(tokenizer, text, "<think>a</think>\n\nPlain answer.")
    # end tags spelled as text (not tokens) end the block lazily
    plain = OutputShape(content={"type": "integer"}, think="optional", think_tags=("[T]", "[/T]"),
                        think_tokens=False)
    assert accepts(tokenizer, plain, "[T]some [thought][/T]\n7")
    assert accepts(tokenizer, plain, "7")
    assert not accepts(tokenizer, plain, "[T]never closed 7")


def test_json_answer_or_calls(tokenizer: Any) -> None:
    calls = call_schemas([tool("f", X_INT, strict=True)], "auto", strict_only=True)
    shape = OutputShape(content=CITY, calls=calls)
    assert accepts(tokenizer, shape, '{"city": "Oslo"}') or accepts(tokenizer, shape, '{"city":"Oslo"}')
    assert accepts(tokenizer, shape, call("f", {"x": 2}))
    assert not accepts(tokenizer, shape, "prose")
    assert not accepts(tokenizer, shape, '{"city": "Rome"}')


def test_shape_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        OutputShape(content=None, calls=())
    with pytest.raises(ValueError):
        OutputShape(content="markdown")


def test_uncompilable_grammar_is_the_clients_error(tokenizer: Any) -> None:
    from afm_core._engine.grammar import GrammarError

    with pytest.raises(GrammarError) as info:
        grammar_processor("start: <no_such_token>\n", tokenizer, 0, param="response_format")
    assert info.value.status == 400 and info.value.param == "response_format"
    assert "no_such_token" not in info.value.message or len(info.value.message) < 400


# -- the engine --------------------------------------------------------------------

def req(text: str, **kw: Any) -> ChatRequest:
    return ChatRequest.from_openai({"messages": [{"role": "user", "content": text}], **kw})


async def complete(engine: Any, r: ChatRequest) -> tuple[dict[str, Any], bool]:
    async with engine.stream(r) as s:
        return await s.collect(), s.grammar_downgraded


async def test_echo_output_that_fits_passes_unchanged(echo_model_dir: Path) -> None:
    tools = [tool("get_weather", CITY, strict=True)]
    said = "Checking.\n\n" + call("get_weather", {"city": "Oslo"})
    async with open_engine(echo_model_dir) as engine:
        c, downgraded = await complete(engine, req(said, tools=tools, temperature=0))
        assert not downgraded
        msg = c["choices"][0]["message"]
        assert c["choices"][0]["finish_reason"] == "tool_calls"
        assert msg["content"] == "Checking.\n\n"
        assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
        c, _ = await complete(engine, req("Plain prose passes too.", tools=tools, temperature=0))
        assert c["choices"][0]["message"]["content"] == "Plain prose passes too."


async def test_strict_tool_under_auto_corrects_a_call_that_breaks_the_schema(echo_model_dir: Path) -> None:
    said = call("get_weather", {"city": "Rome"})  # not in the enum
    async with open_engine(echo_model_dir) as engine:
        loose, downgraded = await complete(engine, req(said, tools=[tool("get_weather", CITY)],
                                                       temperature=0, max_tokens=60))
        assert not downgraded  # nothing strict: nothing to enforce
        args = loose["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        assert json.loads(args) == {"city": "Rome"}  # passes through as the model said it
        strict, downgraded = await complete(engine, req(said, tools=[tool("get_weather", CITY, strict=True)],
                                                        temperature=0, max_tokens=60))
        assert not downgraded
        calls = strict["choices"][0]["message"]["tool_calls"]
        assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Oslo")
        assert engine.statistics().running == 0


async def test_strict_tools_under_auto_on_the_random_model(random_model_dir: Path) -> None:
    tools = [tool("get_weather", CITY, strict=True), tool("get_time", X_INT, strict=True)]
    async with open_engine(random_model_dir) as engine:
        tid = engine._tokenizer.encode("<tool_call>", add_special_tokens=False)[0]
        for seed in range(3):
            # a strong bias makes the random model open a call; the grammar shapes the rest
            r = req("call something", tools=tools, temperature=1.0, seed=seed, max_tokens=80,
                    logit_bias={str(tid): 8.0}, parallel_tool_calls=False, enable_thinking=False)
            c, downgraded = await complete(engine, r)
            assert not downgraded
            choice = c["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            (only,) = choice["message"]["tool_calls"]
            args = json.loads(only["function"]["arguments"])
            if only["function"]["name"] == "get_weather":
                assert args["city"] in ("Paris", "Oslo")
            else:
                assert isinstance(args["x"], int) and set(args) == {"x"}
        # without the bias the model may just talk: free text stays allowed
        c, _ = await complete(engine, req("hello", tools=tools, temperature=1.0, seed=1, max_tokens=8,
                                          enable_thinking=False))
        assert c["choices"][0]["finish_reason"] in ("length", "stop")


async def test_required_tool_call_after_reasoning(random_model_dir: Path) -> None:
    tools = [tool("get_weather", CITY)]
    async with open_engine(random_model_dir) as engine:
        tok = engine._tokenizer
        bias = {str(tok.encode(t, add_special_tokens=False)[0]): 6.0 for t in ("<think>", "</think>")}
        r = req("weather?", tools=tools, tool_choice="required", temperature=1.0, seed=3,
                max_tokens=80, logit_bias=bias, parallel_tool_calls=False)
        c, downgraded = await complete(engine, r)
        assert not downgraded
        choice = c["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert "reasoning_content" in choice["message"]
        (only,) = choice["message"]["tool_calls"]
        assert json.loads(only["function"]["arguments"])["city"] in ("Paris", "Oslo")


async def test_what_cannot_be_enforced_is_flagged(random_model_dir: Path) -> None:
    tools = [tool("f", X_INT, strict=True)]
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": CITY, "strict": True}}
    async with open_engine(random_model_dir) as engine:
        # a call is required, so the strict answer schema cannot hold as well
        _, downgraded = await complete(engine, req("x", tools=tools, tool_choice="required",
                                                   response_format=rf, max_tokens=2))
        assert downgraded
        # strict tools and a strict answer under auto: one grammar holds both
        _, downgraded = await complete(engine, req("x", tools=tools, response_format=rf, max_tokens=40,
                                                   temperature=0, enable_thinking=False))
        assert not downgraded
    async with open_engine(random_model_dir, grammar=False) as engine:
        _, downgraded = await complete(engine, req("x", tools=tools, max_tokens=2))
        assert downgraded
