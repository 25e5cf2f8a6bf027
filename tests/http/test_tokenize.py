"""``POST /tokenize`` and ``POST /detokenize`` (llama.cpp's and vLLM's shapes) and
``GET /tokenizer_info`` (vLLM's) against a real server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from afm_http import ServerConfig
from afm_http.testing import running_server

TEXTS = ["Hello, wörld!", "東京 🚀 and \"quotes\" \\ back", "  leading and trailing  ", "a\nb\tc",
         "<|im_start|>user\nhi<|im_end|>", ""]


async def test_round_trips_equal_the_tokenizer(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        tok = engine._tokenizer
        for text in TEXTS:
            r = await c.post("/tokenize", json={"content": text})
            assert r.status_code == 200, r.text
            ids = r.json()["tokens"]
            assert ids == tok.encode(text, add_special_tokens=False)
            assert r.json() == {"tokens": ids}
            assert tok.decode(ids) == text
            r = await c.post("/detokenize", json={"tokens": ids})
            assert r.status_code == 200 and r.json() == {"content": text, "prompt": text}
        # special spellings are tokens unless parse_special is false
        special = tok.convert_tokens_to_ids("<|im_start|>")
        ids = (await c.post("/tokenize", json={"content": "<|im_start|>"})).json()["tokens"]
        assert ids == [special]
        ids = (await c.post("/tokenize", json={"content": "<|im_start|>", "parse_special": False})).json()["tokens"]
        assert special not in ids and tok.decode(ids) == "<|im_start|>"
        added = (await c.post("/tokenize", json={"content": "hi", "add_special": True})).json()["tokens"]
        assert added == tok.encode("hi", add_special_tokens=True)


async def test_with_pieces(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        text = "wörld 東京 <|im_end|>"
        r = await c.post("/tokenize", json={"content": text, "with_pieces": True})
        assert r.status_code == 200
        tokens = r.json()["tokens"]
        assert [t["id"] for t in tokens] == engine._tokenizer.encode(text, add_special_tokens=False)
        raw = b"".join(t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"])
                       for t in tokens)
        assert raw == text.encode()
        # a piece that is part of a character is its bytes
        assert any(isinstance(t["piece"], list) for t in tokens)
        assert {"id": engine._tokenizer.convert_tokens_to_ids("<|im_end|>"), "piece": "<|im_end|>"} in tokens


async def test_messages_count_what_a_chat_request_prompts(echo_model_dir: Path) -> None:
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count me"}]}
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        r = await c.post("/tokenize", json=chat)
        assert r.status_code == 200
        ids = r.json()["tokens"]
        assert ids == await engine.tokenize_chat(chat)
        # vLLM's answer to a chat body (llama.cpp's clients read "tokens" alike)
        assert r.json() == {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}
        usage = (await c.post("/v1/chat/completions", json=chat)).json()["usage"]
        assert usage["prompt_tokens"] == len(ids)
        r = await c.post("/tokenize", json={**chat, "with_pieces": True})
        assert [t["id"] for t in r.json()["tokens"]] == ids
        r = await c.post("/v1/chat/completions/count_tokens", json=chat)
        assert r.status_code == 200 and r.json() == {"input_tokens": len(ids)}
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        with_tools = (await c.post("/v1/chat/completions/count_tokens", json={**chat, "tools": tools})).json()
        assert with_tools["input_tokens"] == len(await engine.tokenize_chat({**chat, "tools": tools}))
        r = await c.post("/v1/chat/completions/count_tokens", json={"messages": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


async def test_the_openai_sdk_counts_response_input_tokens(echo_model_dir: Path) -> None:
    import openai

    async with running_server(echo_model_dir) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        counted = await client.responses.input_tokens.count(model="m", input="count me",
                                                            instructions="be brief")
        assert counted.object == "response.input_tokens"
        created = await client.responses.create(model="m", input="count me", instructions="be brief",
                                                max_output_tokens=4)
        assert counted.input_tokens == created.usage.input_tokens > 0
        # previous_response_id counts the stored conversation too
        more = await client.responses.input_tokens.count(model="m", input="and me",
                                                         previous_response_id=created.id)
        assert more.input_tokens > counted.input_tokens
        with pytest.raises(openai.BadRequestError):
            await client.responses.input_tokens.count(model="m", input=[{"type": "nope"}])
        await client.close()


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", [], "body"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("/tokenize", {"content": "x", "prompt": "x"}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": ["a"]}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "x", "add_special": 1}, "add_special"),
    ("/tokenize", {"content": "x", "parse_special": "no"}, "parse_special"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens[1]"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
    ("/detokenize", {"tokens": [[1]]}, "tokens[0]"),
])
async def test_bad_input_is_400(echo_model_dir: Path, path: str, body: object, param: str) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        r = await c.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
        r = await c.post(path, content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"


async def test_the_api_key_applies(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir, server=ServerConfig(api_key="k")) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        assert (await c.post("/tokenize", json={"content": "x"})).status_code == 401
        r = await c.post("/detokenize", json={"tokens": []}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json() == {"content": "", "prompt": ""}
        assert (await c.get("/tokenizer_info")).status_code == 401


async def test_vllm_shapes(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        tok = engine._tokenizer
        text = "Hello, wörld <|im_end|>"
        r = await c.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        ids = tok.encode(text, add_special_tokens=False)
        assert r.status_code == 200
        assert r.json() == {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}
        # vLLM's default adds what the tokenizer adds around a text
        r = await c.post("/tokenize", json={"prompt": "hi"})
        assert r.json()["tokens"] == tok.encode("hi", add_special_tokens=True)
        r = await c.post("/tokenize", json={"prompt": "wörld", "return_token_strs": True})
        strs = r.json()["token_strs"]
        assert len(strs) == r.json()["count"] and all(isinstance(t, str) for t in strs)
        chat = {"messages": [{"role": "user", "content": "count me"}], "return_token_strs": True}
        r = (await c.post("/tokenize", json=chat)).json()
        assert r["tokens"] == await engine.tokenize_chat(chat) and len(r["token_strs"]) == r["count"]
        r = await c.post("/detokenize", json={"tokens": ids})
        assert r.json()["prompt"] == text


async def test_tokenizer_info_as_lm_eval_reads_it(echo_model_dir: Path) -> None:
    """What lm-eval 0.4.13's ``RemoteTokenizer`` (``local-completions``' default
    tokenizer) does: ``GET /tokenizer_info`` must have ``eos_token``; ``/tokenize``
    ``{"prompt", "add_special_tokens": false}`` gives ``tokens``; ``/detokenize``
    gives ``prompt``; the eos id is the tokenization of ``eos_token``; the chat
    template renders with jinja2."""
    import jinja2

    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        r = await c.get("/tokenizer_info")
        assert r.status_code == 200
        info = r.json()
        hf = engine._tokenizer._tokenizer
        assert info["tokenizer_class"] == type(hf).__name__
        assert info["eos_token"] == hf.eos_token and info["model_max_length"] == engine.context_length
        assert {"bos_token", "pad_token", "unk_token"} <= set(info)
        assert not any(k.endswith("_file") or k == "name_or_path" for k in info)  # no server paths
        eos_ids = (await c.post("/tokenize", json={"prompt": info["eos_token"],
                                                   "add_special_tokens": False})).json()["tokens"]
        assert eos_ids[0] in engine._tokenizer.eos_token_ids
        ids = (await c.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})).json()["tokens"]
        assert (await c.post("/detokenize", json={"tokens": ids})).json()["prompt"] == "test"
        rendered = jinja2.Environment().from_string(info["chat_template"]).render(
            messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
        assert "hi" in rendered
        # one --model: any name is served by it, as on the other routes
        assert (await c.get("/tokenizer_info", params={"model": "other"})).json() == info
