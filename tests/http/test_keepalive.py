"""Keepalives while a streaming request waits: a real hypercorn on 127.0.0.1, the echo
model with one batch slot held by a long stream (the hog), and a second streaming
request on each route that waits for the slot.

The waits are deterministic: the hog is cancelled only once the waiting request heard
its first keepalive (or, with keepalives off, once the engine decoded 500 steps while it waited)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
import trio

from afm_http import ServerConfig
from afm_http.testing import running_server
from tests.http.helpers import CHAT, body

COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
CANCEL = "/v1/chat/completions/{}/cancel"
CHAT_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
KEEPALIVE = ": keepalive"
FAST = ServerConfig(keepalive_seconds=0.05)
TEXT = "waiting politely"

WAITING: dict[str, dict[str, Any]] = {
    CHAT: body(TEXT, stream=True),
    COMPLETIONS: {"model": "m", "prompt": CHAT_PROMPT.format(TEXT), "max_tokens": 50, "stream": True},
    RESPONSES: {"model": "m", "input": TEXT, "stream": True},
}


@asynccontextmanager
async def hogged(c: httpx.AsyncClient) -> AsyncIterator[None]:
    """The only batch slot held by a long chat stream until it is cancelled (``release``)."""
    async with c.stream("POST", CHAT, json=body("word " * 5000, stream=True),
                        headers={"X-Request-ID": "hog"}) as r:
        lines = r.aiter_lines()  # kept alive: a dropped iterator closes the connection
        while not (await lines.__anext__()).startswith("data: "):
            pass  # it is decoding: the slot is taken
        yield


async def release(c: httpx.AsyncClient) -> None:
    assert (await c.post(CANCEL.format("hog"))).status_code == 200


async def waiting_lines(c: httpx.AsyncClient, path: str) -> list[str]:
    """The waiting request's body lines; the hog goes when the first keepalive came."""
    lines: list[str] = []
    async with hogged(c), c.stream("POST", path, json=WAITING[path]) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            lines.append(line)
            if line == KEEPALIVE and lines.count(KEEPALIVE) == 1:
                await release(c)
    return lines


def data_events(lines: list[str]) -> list[Any]:
    """The data lines parsed (``[DONE]`` kept as the string); comments skipped, framing checked."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
        else:
            assert line in ("", KEEPALIVE) or line.startswith("event: "), line
    return out


def assert_keepalives_only_while_waiting(lines: list[str], before: int) -> None:
    """A keepalive came before the first data line past the ``before`` opening ones, and
    every keepalive is a whole SSE comment; none follows the last data line."""
    data_at = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    first_keepalive = lines.index(KEEPALIVE)
    assert first_keepalive < data_at[before]
    last_data = data_at[-1]
    assert KEEPALIVE not in lines[last_data:]
    for i, line in enumerate(lines):
        if line == KEEPALIVE:
            assert lines[i + 1] == "" and (i == 0 or lines[i - 1] == "")


async def test_chat_keepalive_while_queued(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir, server=FAST, max_batch=1) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        lines = await waiting_lines(c, CHAT)
    assert_keepalives_only_while_waiting(lines, before=0)
    events = data_events(lines)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_completions_keepalive_while_queued(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir, server=FAST, max_batch=1) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        lines = await waiting_lines(c, COMPLETIONS)
    assert_keepalives_only_while_waiting(lines, before=0)
    events = data_events(lines)
    assert events[-1] == "[DONE]"
    assert "".join(ch["choices"][0]["text"] for ch in events[:-1]) == TEXT
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_completions_keepalive_with_several_choices(echo_model_dir: Path) -> None:
    """Several engine streams (n = 2): one waits for the slot while the hog runs."""
    payload = {**WAITING[COMPLETIONS], "n": 2}
    async with running_server(echo_model_dir, server=FAST, max_batch=1) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        lines: list[str] = []
        async with hogged(c), c.stream("POST", COMPLETIONS, json=payload) as r:
            async for line in r.aiter_lines():
                lines.append(line)
                if line == KEEPALIVE and lines.count(KEEPALIVE) == 1:
                    await release(c)
    assert_keepalives_only_while_waiting(lines, before=0)
    events = data_events(lines)
    assert events[-1] == "[DONE]"
    for index in (0, 1):
        assert "".join(ch["choices"][0]["text"] for ch in events[:-1]
                       if ch["choices"][0]["index"] == index) == TEXT


async def test_responses_keepalive_is_an_event(echo_model_dir: Path) -> None:
    """/v1/responses keeps a waiting stream alive with ``response.in_progress`` events, not
    comments: Codex's idle timer counts SSE events only."""
    async with running_server(echo_model_dir, server=FAST, max_batch=1) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        lines: list[str] = []
        async with hogged(c), c.stream("POST", RESPONSES, json=WAITING[RESPONSES]) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                lines.append(line)
                if line == "event: response.in_progress" and lines.count(line) == 3:
                    await release(c)  # two keepalives came while it waited
    assert not any(line.startswith(":") for line in lines)
    events = data_events(lines)
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created"] + ["response.in_progress"] * 3
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events[1:4]:
        assert e["response"]["id"] == events[0]["response"]["id"]
        assert e["response"]["status"] == "in_progress" and e["response"]["output"] == []
    assert types[-1] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == TEXT


async def test_messages_pings_follow_the_setting(echo_model_dir: Path) -> None:
    payload = {"model": "m", "max_tokens": 100, "stream": True,
               "messages": [{"role": "user", "content": TEXT}]}
    async with running_server(echo_model_dir, server=FAST, max_batch=1) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        names: list[str] = []
        async with hogged(c), c.stream("POST", MESSAGES, json=payload) as r:
            async for line in r.aiter_lines():
                assert not line.startswith(":")  # Anthropic's keepalive is its ping event
                if line.startswith("event: "):
                    names.append(line[7:])
                    if names == ["message_start", "ping", "ping"]:
                        await release(c)  # one ping at the start, one while waiting
    assert names[:3] == ["message_start", "ping", "ping"]
    assert names[-1] == "message_stop"


class Tee(httpx.AsyncBaseTransport):
    """An HTTP transport that notes when a response body carried a keepalive (``marker``
    ``times`` times: a comment, the Responses stream's third ``response.in_progress``, or
    a third ``ping``).  ``lib`` is ``httpx``, or ``httpx2`` for the anthropic SDK."""

    def __init__(self, marker: bytes = KEEPALIVE.encode(), times: int = 1, lib: Any = httpx) -> None:
        self.lib = lib
        self.inner = lib.AsyncHTTPTransport()
        self.heard = trio.Event()
        self.marker = marker
        self.times = times

    async def handle_async_request(self, request: Any) -> Any:
        lib = self.lib
        response = await self.inner.handle_async_request(request)
        raw = response.stream
        assert isinstance(raw, lib.AsyncByteStream)
        heard, marker, times = self.heard, self.marker, self.times

        class Stream(lib.AsyncByteStream):  # type: ignore[name-defined,misc]
            async def __aiter__(self) -> AsyncIterator[bytes]:
                body = b""
                async for chunk in raw:
                    body += chunk
                    if body.count(marker) >= times:
                        heard.set()
                    yield chunk

            async def aclose(self) -> None:
                await raw.aclose()

        return lib.Response(response.status_code, headers=response.headers, stream=Stream(),
                            extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_openai_sdk_reads_through_keepalives(echo_model_dir: Path, api: str) -> None:
    tee = Tee() if api == "chat" else Tee(b"event: response.in_progress", 3)
    async with running_server(echo_model_dir, server=FAST, max_batch=1) as (url, _), \
            httpx.AsyncClient(base_url=url) as c, httpx.AsyncClient(transport=tee) as http:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                    http_client=http)
        parts: list[str] = []
        types: list[str] = []
        async with hogged(c):
            if api == "chat":
                chat = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": TEXT}], stream=True)

                async def read() -> None:
                    async for chunk in chat:
                        if chunk.choices and chunk.choices[0].delta.content:
                            parts.append(chunk.choices[0].delta.content)
            else:
                responses = await client.responses.create(model="m", input=TEXT, stream=True)

                async def read() -> None:
                    async for event in responses:
                        types.append(event.type)
                        if event.type == "response.output_text.delta":
                            parts.append(event.delta)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                await tee.heard.wait()  # the SDK is reading a body that carried a keepalive
                await release(c)
        assert tee.heard.is_set() and "".join(parts) == TEXT
        if api == "responses":  # the SDK parsed the repeated events as its own type
            assert types[:4] == ["response.created"] + ["response.in_progress"] * 3
            assert types[-1] == "response.completed"


async def test_anthropic_sdk_reads_through_pings(echo_model_dir: Path) -> None:
    """The anthropic SDK's stream reads a body whose pings came while the request waited,
    then the whole message."""
    tee = Tee(b"event: ping", 3, httpx2)  # the opening ping and two while it waited
    async with running_server(echo_model_dir, server=FAST, max_batch=1) as (url, _), \
            httpx.AsyncClient(base_url=url) as c, httpx2.AsyncClient(transport=tee) as http:
        client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0, http_client=http)
        types: list[str] = []
        events: list[Any] = []
        async with hogged(c):
            stream = await client.messages.create(model="m", max_tokens=100, stream=True,
                                                  messages=[{"role": "user", "content": TEXT}])

            async def read() -> None:
                async for event in stream:
                    types.append(event.type)
                    events.append(event)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                await tee.heard.wait()
                await release(c)
        # the SDK skips the pings (its stream drops them); it read through them to the end
        assert tee.heard.is_set() and types[0] == "message_start" and types[-1] == "message_stop"
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta"
                       and e.delta.type == "text_delta")
        assert text == TEXT


async def test_zero_sends_no_keepalive(echo_model_dir: Path) -> None:
    off = ServerConfig(keepalive_seconds=0)
    async with running_server(echo_model_dir, server=off, max_batch=1) as (url, engine), \
            httpx.AsyncClient(base_url=url) as c:
        for path in (CHAT, COMPLETIONS, RESPONSES):
            lines: list[str] = []
            async with hogged(c), c.stream("POST", path, json=WAITING[path]) as r:
                with trio.fail_after(10):
                    while engine.statistics().waiting < 1:
                        await trio.sleep(0.01)
                # the hog decodes 500 engine steps while the request waits (the hog has
                # thousands of tokens left); with keepalives off nothing is written meanwhile
                steps = engine.statistics().steps
                with trio.fail_after(60):
                    while engine.statistics().steps < steps + 500:
                        await trio.sleep(0.01)
                await release(c)
                lines = [line async for line in r.aiter_lines()]
            assert not any(line.startswith(":") for line in lines), (path, lines[:5])
            assert data_events(lines), path
            if path == RESPONSES:  # no repeated response.in_progress either
                assert lines.count("event: response.in_progress") == 1
