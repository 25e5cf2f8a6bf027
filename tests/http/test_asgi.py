"""In-process ASGI tests: races a real socket cannot hit on purpose."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from afm_core import open_engine
from afm_http import create_app


def _scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "extensions": {},
    }


async def test_disconnect_before_body_iteration_leaves_the_engine(echo_model_dir: Path) -> None:
    """The client goes away right after the status line: quart never iterates the
    SSE body, yet the engine stream must be left (no registered, generating request)."""
    payload = json.dumps({"messages": [{"role": "user", "content": "word " * 3000}],
                          "stream": True}).encode()
    async with open_engine(echo_model_dir) as engine:
        app = create_app(engine)
        started = trio.Event()
        inbox = [{"type": "http.request", "body": payload, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if inbox:
                return inbox.pop()
            await started.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.start":
                started.set()
                await trio.sleep_forever()  # the disconnect's cancellation lands here

        headers = [(b"host", b"127.0.0.1:2"), (b"content-type", b"application/json"),
                   (b"x-request-id", b"gone-early")]
        with trio.fail_after(30):
            await app(_scope("/v1/chat/completions", headers), receive, send)
        assert sent[0]["status"] == 200
        assert not any(m.get("body") for m in sent[1:])
        stats = engine.statistics()
        assert stats.requests_active == 0
        assert engine.cancel("gone-early") is False
        assert len(app.afm_inflight) == 0 and app.afm_drain() == 0


async def test_route_table(echo_model_dir: Path) -> None:
    """Every route module registered its rules, with the methods quart derives from them."""
    async with open_engine(echo_model_dir) as engine:
        app = create_app(engine)
        rules = {(r.rule, frozenset(r.methods or ())) for r in app.url_map.iter_rules()
                 if r.endpoint != "static"}
    get, post = frozenset({"GET", "HEAD", "OPTIONS"}), frozenset({"POST", "OPTIONS"})
    delete = frozenset({"DELETE", "OPTIONS"})
    assert rules == {
        ("/v1/chat/completions", post),
        ("/v1/chat/completions/<path:target>/cancel", post),
        ("/v1/chat/completions/count_tokens", post),
        ("/v1/completions", post),
        ("/v1/messages", post),
        ("/v1/messages/count_tokens", post),
        ("/v1/responses", post),
        ("/v1/responses/input_tokens", post),
        ("/v1/responses/compact", post),
        ("/v1/responses/<response_id>", get),
        ("/v1/responses/<response_id>", delete),
        ("/v1/responses/<response_id>/cancel", post),
        ("/v1/responses/<response_id>/input_items", get),
        ("/tokenize", post),
        ("/detokenize", post),
        ("/tokenizer_info", get),
        ("/v1/embeddings", post),
        ("/v1/models", get),
        ("/v1/models/<path:model_id>", get),
        ("/health", get),
        ("/metrics", get),
        ("/admin/drain", post),
        ("/admin/drain", delete),
        ("/", get),
        ("/ui/<name>", get),
        ("/api/chat", post),
        ("/api/generate", post),
        ("/api/embed", post),
        ("/api/embeddings", post),
        ("/api/tags", get),
        ("/api/show", post),
        ("/api/ps", get),
        ("/api/version", get),
    }
