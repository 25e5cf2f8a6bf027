"""Shared helpers for the HTTP tests: request bodies and a strict SSE reader."""

from __future__ import annotations

import json

import httpx

CHAT = "/v1/chat/completions"


def body(text: str, **kw: object) -> dict:
    return {"messages": [{"role": "user", "content": text}], **kw}


async def sse(client: httpx.AsyncClient, payload: dict, headers: dict | None = None):
    """(response, parsed data events, raw data strings); checks the SSE framing."""
    events, raw = [], []
    async with client.stream("POST", CHAT, json=payload, headers=headers or {}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                raw.append(data)
                if data != "[DONE]":
                    events.append(json.loads(data))
            else:
                assert line == "", line
    return r, events, raw


def text_of(events: list, key: str = "content") -> str:
    """One delta channel of a chunk list, joined."""
    return "".join(
        c["choices"][0]["delta"].get(key) or "" for c in events if c.get("choices")
    )
