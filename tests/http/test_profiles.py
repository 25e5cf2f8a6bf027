"""``X-AFM-Profile`` on every generating wire API (issue 18: "profile"), end to end:
a real hypercorn server on the echo model, httpx and the real ``openai`` and
``anthropic`` SDKs.  Each API carries the engine's one profile in its own form
(completions: chat's ``afm_profile`` chunk after the usage; Messages: an
``afm_profile`` event between ``message_delta`` and ``message_stop``;
Responses: an ``afm.profile`` event before the terminal event) and as a
top-level field of the non-streaming answer; a bad header value is a 400 in
the API's own error envelope."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from afm_http.testing import running_server

TRUE = {"X-AFM-Profile": "true"}
EXTENDED = {"X-AFM-Profile": "extended"}
BAD = {"X-AFM-Profile": "sometimes"}
FIELDS = {"prefill_tok_s", "decode_tok_s", "ttft_s", "queue_s", "prompt_tokens", "completion_tokens",
          "cached_tokens"}


@pytest.fixture
async def server(echo_model_dir: Path):
    async with running_server(echo_model_dir) as (url, engine):
        yield url, engine


async def _sse(h: httpx.AsyncClient, path: str, payload: dict[str, Any],
               headers: dict[str, str]) -> tuple[list[str | None], list[Any]]:
    """(event names, data: parsed JSON, or the literal ``[DONE]``), one pair per frame."""
    names: list[str | None] = []
    datas: list[Any] = []
    name: str | None = None
    async with h.stream("POST", path, json=payload, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                names.append(name)
                datas.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                name = None
    return names, datas


def _basic(profile: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> None:
    """A basic profile: its own fields, the same token counts as the usage."""
    assert FIELDS <= set(profile), profile
    assert profile["prompt_tokens"] == prompt_tokens and profile["completion_tokens"] == completion_tokens


def _extended(profile: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> None:
    assert set(profile) == {"summary", "samples"} and isinstance(profile["samples"], list)
    _basic(profile["summary"], prompt_tokens, completion_tokens)


def _openai_400(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "X-AFM-Profile" and error["code"] == "invalid_header"
    assert error["type"] == "invalid_request_error" and "X-AFM-Profile" in error["message"]


# -- /v1/completions -------------------------------------------------------------------


async def test_completions_profile_after_the_usage_and_before_done(server) -> None:
    url, _ = server
    payload = {"model": "m", "prompt": "profile me please", "max_tokens": 8, "stream": True,
               "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        _, datas = await _sse(h, "/v1/completions", payload, TRUE)
        assert datas[-1] == "[DONE]"
        profile, usage = datas[-2], datas[-3]
        assert list(profile) == ["afm_profile"]  # chat's form: no choices, no id
        assert usage["choices"] == [] and usage["object"] == "text_completion"
        assert datas[-4]["choices"][0]["finish_reason"] is not None
        _basic(profile["afm_profile"], usage["usage"]["prompt_tokens"], usage["usage"]["completion_tokens"])
        # extended, without include_usage: the last object before [DONE]
        _, datas = await _sse(h, "/v1/completions", {**payload, "stream_options": {}}, EXTENDED)
        assert list(datas[-2]) == ["afm_profile_extended"] and datas[-1] == "[DONE]"
        assert not any("usage" in d for d in datas[:-1])
        # n = 2: choice 0's profile, once, after the usage of both choices
        _, datas = await _sse(h, "/v1/completions", {**payload, "n": 2}, TRUE)
        assert [d for d in datas if "afm_profile" in d] == [datas[-2]]
        assert datas[-3]["usage"]["completion_tokens"] == 2 * datas[-2]["afm_profile"]["completion_tokens"]
        assert {c["index"] for d in datas[:-3] for c in d.get("choices", ())} == {0, 1}
        # not streamed: a top-level field, as chat's
        for headers, check in ((TRUE, _basic), (EXTENDED, _extended)):
            r = await h.post("/v1/completions", json={**payload, "stream": False}, headers=headers)
            data = r.json()
            key = "afm_profile_extended" if headers is EXTENDED else "afm_profile"
            check(data[key], data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"])
            assert data["choices"][0]["finish_reason"] in ("stop", "length")
        r = await h.post("/v1/completions", json={**payload, "stream": False})
        assert r.status_code == 200 and "afm_profile" not in r.json()
        # a bad value: a 400 in OpenAI's envelope, streamed or not
        for stream in (False, True):
            _openai_400(await h.post("/v1/completions", json={**payload, "stream": stream}, headers=BAD))


async def test_completions_profile_through_the_openai_sdk(server) -> None:
    url, _ = server
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = await client.completions.create(model="m", prompt="sdk profile", max_tokens=6, stream=True,
                                             stream_options={"include_usage": True}, extra_headers=TRUE)
    chunks = [c async for c in stream]
    usage = chunks[-2].usage
    assert usage is not None and chunks[-2].choices == []
    extra = chunks[-1].model_extra or {}
    _basic(extra["afm_profile"], usage.prompt_tokens, usage.completion_tokens)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks[:-2])
    done = await client.completions.create(model="m", prompt="sdk profile", max_tokens=6,
                                           extra_headers=EXTENDED)
    assert done.usage is not None and done.choices[0].finish_reason in ("stop", "length")
    _extended((done.model_extra or {})["afm_profile_extended"], done.usage.prompt_tokens,
              done.usage.completion_tokens)
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="m", prompt="x", max_tokens=2, extra_headers=BAD)
    assert info.value.param == "X-AFM-Profile" and info.value.code == "invalid_header"
    await client.close()


# -- /v1/messages ----------------------------------------------------------------------


async def test_messages_profile_event_between_message_delta_and_message_stop(server) -> None:
    url, _ = server
    payload = {"model": "m", "max_tokens": 16, "stream": True,
               "messages": [{"role": "user", "content": "profile the messages"}]}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        for headers, key, check in ((TRUE, "afm_profile", _basic), (EXTENDED, "afm_profile_extended", _extended)):
            names, datas = await _sse(h, "/v1/messages", payload, headers)
            assert names[0] == "message_start" and names[-3:] == ["message_delta", "afm_profile", "message_stop"]
            assert [d["type"] for d in datas] == names
            assert names.count("afm_profile") == 1
            event, delta, start = datas[-2], datas[-3], datas[0]
            assert set(event) == {"type", key}
            usage = delta["usage"]
            prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
            assert prompt == start["message"]["usage"]["input_tokens"]
            check(event[key], prompt, usage["output_tokens"])
            r = await h.post("/v1/messages", json={**payload, "stream": False}, headers=headers)
            message = r.json()
            usage = message["usage"]
            check(message[key], usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"])
            assert message["content"][0]["text"] == "profile the messages"
        names, _ = await _sse(h, "/v1/messages", payload, {})
        assert "afm_profile" not in names and names[-2:] == ["message_delta", "message_stop"]
        # a bad value: a 400 in Anthropic's envelope
        for stream in (False, True):
            r = await h.post("/v1/messages", json={**payload, "stream": stream}, headers=BAD)
            assert r.status_code == 400, r.text
            err = r.json()
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert "X-AFM-Profile" in err["error"]["message"]


async def test_messages_profile_through_the_anthropic_sdk(server) -> None:
    url, _ = server
    client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": "anthropic sdk profile"}]
    async with client.messages.stream(model="m", max_tokens=16, messages=messages,
                                      extra_headers=TRUE) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[-3:] == ["message_delta", "afm_profile", "message_stop"]
    assert final.content[0].text == "anthropic sdk profile" and final.stop_reason == "end_turn"  # type: ignore[union-attr]
    profile = (events[-2].model_extra or {})["afm_profile"]
    _basic(profile, final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0),
           final.usage.output_tokens)
    raw = await client.messages.create(model="m", max_tokens=16, messages=messages, stream=True,
                                       extra_headers=EXTENDED)
    got = [event async for event in raw]
    assert [e.type for e in got][-3:] == ["message_delta", "afm_profile", "message_stop"]
    _extended((got[-2].model_extra or {})["afm_profile_extended"],
              profile["prompt_tokens"], profile["completion_tokens"])
    message = await client.messages.create(model="m", max_tokens=16, messages=messages, extra_headers=TRUE)
    assert message.content[0].text == "anthropic sdk profile"  # type: ignore[union-attr]
    _basic((message.model_extra or {})["afm_profile"], profile["prompt_tokens"], profile["completion_tokens"])
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model="m", max_tokens=4, messages=messages, extra_headers=BAD)
    assert info.value.status_code == 400 and "X-AFM-Profile" in info.value.message
    await client.close()


# -- /v1/responses ---------------------------------------------------------------------


async def test_responses_profile_event_before_the_terminal_event(server) -> None:
    url, _ = server
    payload = {"model": "m", "input": "profile the responses", "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        for headers, key, check in ((TRUE, "afm_profile", _basic), (EXTENDED, "afm_profile_extended", _extended)):
            names, datas = await _sse(h, "/v1/responses", payload, headers)
            assert names[-2:] == ["afm.profile", "response.completed"] and names.count("afm.profile") == 1
            assert [d["type"] for d in datas] == names
            assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
            event, final = datas[-2], datas[-1]["response"]
            assert set(event) == {"type", "sequence_number", key}
            assert final[key] == event[key] and key not in datas[0]["response"]
            check(event[key], final["usage"]["input_tokens"], final["usage"]["output_tokens"])
            r = await h.post("/v1/responses", json={**payload, "stream": False}, headers=headers)
            data = r.json()
            check(data[key], data["usage"]["input_tokens"], data["usage"]["output_tokens"])
            assert data["output"][0]["content"][0]["text"] == "profile the responses"
            stored = (await h.get(f"/v1/responses/{data['id']}")).json()
            assert stored[key] == data[key]
        names, _ = await _sse(h, "/v1/responses", payload, {})
        assert "afm.profile" not in names and names[-1] == "response.completed"
        # max_output_tokens: before response.incomplete
        names, datas = await _sse(h, "/v1/responses", {**payload, "max_output_tokens": 2}, TRUE)
        assert names[-2:] == ["afm.profile", "response.incomplete"]
        _basic(datas[-2]["afm_profile"], datas[-1]["response"]["usage"]["input_tokens"], 2)
        # n = 2: choice 0's profile, once, after every choice's items
        names, datas = await _sse(h, "/v1/responses", {**payload, "n": 2}, TRUE)
        assert names[-2:] == ["afm.profile", "response.completed"] and names.count("afm.profile") == 1
        final = datas[-1]["response"]
        assert {o["choice_index"] for o in final["output"]} == {0, 1}
        assert final["usage"]["output_tokens"] == 2 * datas[-2]["afm_profile"]["completion_tokens"]
        r = await h.post("/v1/responses", json={**payload, "n": 2, "stream": False}, headers=TRUE)
        data = r.json()
        assert len(data["output"]) == 2 and data["usage"]["output_tokens"] == 2 * data["afm_profile"]["completion_tokens"]
        for stream in (False, True):
            _openai_400(await h.post("/v1/responses", json={**payload, "stream": stream}, headers=BAD))


async def test_responses_profile_through_the_openai_sdk(server) -> None:
    url, _ = server
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    async with client.responses.stream(model="m", input="openai sdk profile", extra_headers=TRUE) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    kinds: list[str] = [e.type for e in events]
    assert kinds[-2:] == ["afm.profile", "response.completed"]
    assert final.output_text == "openai sdk profile" and final.status == "completed"
    assert final.usage is not None
    profile = (final.model_extra or {})["afm_profile"]
    assert (events[-2].model_extra or {})["afm_profile"] == profile
    _basic(profile, final.usage.input_tokens, final.usage.output_tokens)
    raw = await client.responses.create(model="m", input="openai sdk profile", stream=True,
                                        extra_headers=EXTENDED)
    got = [event async for event in raw]
    assert [e.type for e in got][-2:] == ["afm.profile", "response.completed"]
    _extended((got[-2].model_extra or {})["afm_profile_extended"], final.usage.input_tokens,
              final.usage.output_tokens)
    done = await client.responses.create(model="m", input="openai sdk profile", extra_headers=TRUE)
    assert done.output_text == "openai sdk profile"
    _basic((done.model_extra or {})["afm_profile"], final.usage.input_tokens, final.usage.output_tokens)
    # n > 1 through the stream helper: choice 0's profile, the final response whole
    async with client.responses.stream(model="m", input="openai sdk profile", extra_body={"n": 2},
                                       extra_headers=TRUE) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds.count("afm.profile") == 1 and kinds[-2:] == ["afm.profile", "response.completed"]
    assert [(o.model_extra or {})["choice_index"] for o in final.output] == [0, 1]
    assert "afm_profile" in (final.model_extra or {})
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="m", input="x", extra_headers=BAD)
    assert info.value.param == "X-AFM-Profile" and info.value.code == "invalid_header"
    await client.close()


async def test_speculation_streams_its_tokens_and_reports_them(tmp_path: Path) -> None:
    """A server with prompt lookup on: the stream carries several tokens per
    engine step through the wire pipeline; the profile and /metrics count them."""
    from afm_core.testing import make_echo_model

    model = make_echo_model(tmp_path / "echo", all_positions=True)
    text = "to be or not to be, to be or not to be, that is the question"
    payload = {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True,
               "temperature": 0, "stream_options": {"include_usage": True}}
    async with running_server(model, prompt_lookup=4, warmup=False) as (url, _), \
            httpx.AsyncClient(base_url=url) as h:
        _, datas = await _sse(h, "/v1/chat/completions", payload, TRUE)
        content = "".join(d["choices"][0]["delta"].get("content") or "" for d in datas
                          if isinstance(d, dict) and d.get("choices"))
        assert content == text
        profile = next(d["afm_profile"] for d in datas if isinstance(d, dict) and "afm_profile" in d)
        assert 0 < profile["spec_accepted"] <= profile["spec_proposed"]
        metrics = (await h.get("/metrics")).text
        accepted = next(line for line in metrics.splitlines()
                        if line.startswith("afm_spec_accepted_tokens_total"))
        assert float(accepted.split()[-1]) == profile["spec_accepted"]
