"""The soak's wire APIs: one request shape and one reader per route.

Every API is read into the chat vocabulary: the answer text, and a finish of
``stop``, ``length`` or ``cancelled`` (or a failure), so the soak checks the
same invariants on each.  ``completions`` sends the chat prompt's token ids
(from ``/tokenize``), so the echo model echoes the message there too.
Anthropic Messages has no cancelled stop reason: a cancelled message ends
with ``end_turn`` (read as ``stop``), and the soak checks it as a prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

APIS = ("chat", "completions", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "messages": "/v1/messages", "responses": "/v1/responses"}


async def payload(client: httpx.AsyncClient, api: str, text: str, *, streaming: bool,
                  extra: dict[str, Any]) -> dict[str, Any]:
    """The request body of ``api`` for one user message ``text``."""
    messages = [{"role": "user", "content": text}]
    max_tokens = extra.get("max_tokens")
    sampling = {k: v for k, v in extra.items() if k != "max_tokens"}
    if api == "chat":
        body: dict[str, Any] = {"messages": messages, "stream": streaming}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
    elif api == "completions":
        r = await client.post("/tokenize", json={"messages": messages})
        r.raise_for_status()
        body = {"prompt": r.json()["tokens"], "stream": streaming,
                "max_tokens": max_tokens if max_tokens is not None else 4096}
    elif api == "messages":
        body = {"model": "afm", "messages": messages, "stream": streaming,
                "max_tokens": max_tokens if max_tokens is not None else 4096}
    else:
        body = {"input": text, "stream": streaming, "store": False}
        if max_tokens is not None:
            body["max_output_tokens"] = max_tokens
    return {**body, **sampling}


def read_body(api: str, obj: dict[str, Any]) -> tuple[str, str | None]:
    """``(text, finish)`` of a non-streamed answer."""
    if api == "chat":
        choice = obj["choices"][0]
        return choice["message"]["content"] or "", choice["finish_reason"]
    if api == "completions":
        choice = obj["choices"][0]
        return choice["text"], choice["finish_reason"]
    if api == "messages":
        text = "".join(b["text"] for b in obj["content"] if b["type"] == "text")
        return text, _anthropic_finish(obj["stop_reason"])
    text = "".join(part["text"] for item in obj["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    return text, _responses_finish(obj)


@dataclass
class StreamReader:
    """One streamed answer of ``api``, fed each SSE ``data`` payload."""

    api: str
    pieces: list[str] = field(default_factory=list)
    finish: str | None = None
    done: bool = False
    error: str | None = None
    chunks: int = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, data: str) -> None:
        if data == "[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        self.chunks += 1
        if self.api in ("chat", "completions"):
            if "error" in obj:
                self.error = str(obj["error"])
                return
            if obj["choices"]:
                choice = obj["choices"][0]
                piece = choice.get("text") if self.api == "completions" else choice["delta"].get("content")
                self.pieces.append(piece or "")
                self.finish = choice["finish_reason"] or self.finish
            return
        kind = obj.get("type")
        if self.api == "messages":
            if kind == "content_block_delta" and obj["delta"]["type"] == "text_delta":
                self.pieces.append(obj["delta"]["text"])
            elif kind == "message_delta":
                self.finish = _anthropic_finish(obj["delta"]["stop_reason"])
            elif kind == "message_stop":
                self.done = True
            elif kind == "error":
                self.error = str(obj["error"])
            return
        if kind == "response.output_text.delta":
            self.pieces.append(obj["delta"])
        elif kind in ("response.completed", "response.incomplete"):
            self.finish = _responses_finish(obj["response"])
            self.done = True
        elif kind in ("response.failed", "error"):
            self.error = str(obj)[:200]


def _anthropic_finish(stop_reason: str | None) -> str | None:
    return {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
            "tool_use": "tool_calls"}.get(stop_reason or "", stop_reason)


def _responses_finish(resp: dict[str, Any]) -> str | None:
    status = resp.get("status")
    if status == "completed":
        return "stop"
    if status == "cancelled":
        return "cancelled"
    if status == "incomplete":
        reason = (resp.get("incomplete_details") or {}).get("reason")
        return "length" if reason == "max_output_tokens" else str(reason)
    return status
