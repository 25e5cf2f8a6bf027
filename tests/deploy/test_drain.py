"""Draining a replica (``afm_http._drain``): real hypercorn on loopback, echo model.

On a drain (``serve_engine(drain_trigger=...)``, i.e. SIGTERM under
``afm serve --drain-timeout S``, or ``POST /admin/drain``) ``/health`` is 503
at once, new generation requests get 503 + ``Retry-After`` in their API's
envelope, cancel and the other routes still work, running streams finish up
to the drain timeout and the rest end ``cancelled`` then ``[DONE]``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
import trio

from afm_core import open_engine
from afm_core._cli import build_parser
from afm_http import ServerConfig, serve_engine
from afm_http.testing import running_server

from .cluster import ReplicaProcess, free_port

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "word " * 6000}], "stream": True}
SHORT = {"messages": [{"role": "user", "content": "word " * 400}], "stream": True, "max_tokens": 150}
IDLE = dict.fromkeys(("running", "waiting", "requests_active", "inflight"), 0)


async def read_stream(c: httpx.AsyncClient, body: dict, rid: str, frames: list[str],
                      first: trio.Event) -> None:
    async with c.stream("POST", CHAT, json=body, headers={"X-Request-ID": rid}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                frames.append(line[6:])
                first.set()


def finish_of(frames: list[str]) -> str | None:
    assert frames[-1] == "[DONE]", frames[-2:]
    return json.loads(frames[-2])["choices"][0]["finish_reason"]


async def check_refusals(c: httpx.AsyncClient, reason: str) -> None:
    """What a draining server answers (besides the streams it runs)."""
    health = await c.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "draining" and health.json()["draining"]["reason"] == reason
    refused = await c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "draining"
    assert refused.json()["error"]["type"] == "server_error"
    anthropic = await c.post("/v1/messages", json={
        "model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
    assert "draining" in anthropic.json()["error"]["message"] or "shutting" in \
        anthropic.json()["error"]["message"]
    for path in ("/v1/completions", "/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize",
                 f"{CHAT}/count_tokens", "/v1/messages/count_tokens", "/v1/responses/input_tokens",
                 "/v1/responses/compact"):
        assert (await c.post(path, json={})).status_code == 503, path
    # not new work: still served
    assert (await c.post(f"{CHAT}/nobody/cancel")).status_code == 404
    assert (await c.get("/v1/models")).status_code == 200
    assert "afm_draining 1" in (await c.get("/metrics")).text


async def serve_with_triggers(model: Path, cfg: ServerConfig, stop: trio.Event, drain: trio.Event,
                              body, returned: trio.Event) -> None:  # type: ignore[no-untyped-def]
    async with open_engine(model) as engine, trio.open_nursery() as nursery:
        async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
            await serve_engine(engine, host="127.0.0.1", port=0, server=cfg, quiet=True,
                               shutdown_trigger=stop.wait, drain_trigger=drain.wait,
                               task_status=task_status)
            returned.set()

        binds = await nursery.start(serve)
        async with httpx.AsyncClient(base_url=binds[0], timeout=60) as c:
            await body(c, engine)
        with trio.fail_after(30):  # serve_engine returns by itself once drained
            await returned.wait()
        assert engine.statistics().requests_active == 0


async def test_drain_lets_running_streams_finish(echo_model_dir: Path) -> None:
    stop, drain, returned = trio.Event(), trio.Event(), trio.Event()
    frames: list[str] = []

    async def body(c: httpx.AsyncClient, engine: object) -> None:
        assert (await c.get("/health")).json()["draining"] is None
        first = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stream, c, SHORT, "finishes-in-drain", frames, first)
            await first.wait()
            drain.set()
            await trio.lowlevel.checkpoint()  # the drain task begins the drain
            await check_refusals(c, "shutdown")
            # a shutdown's drain cannot be undone
            assert (await c.delete("/admin/drain")).status_code == 409
        assert finish_of(frames) == "length"  # ran to its end, not cancelled

    await serve_with_triggers(echo_model_dir, ServerConfig(drain_timeout=30), stop, drain, body,
                              returned)


async def test_drain_timeout_cancels_what_is_left(echo_model_dir: Path) -> None:
    stop, drain, returned = trio.Event(), trio.Event(), trio.Event()
    frames: list[str] = []

    async def body(c: httpx.AsyncClient, engine: object) -> None:
        first = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stream, c, LONG, "outlives-drain", frames, first)
            await first.wait()
            with trio.fail_after(20):
                drain.set()
                await returned.wait()
        assert finish_of(frames) == "cancelled"

    await serve_with_triggers(echo_model_dir, ServerConfig(drain_timeout=0.5), stop, drain, body,
                              returned)


async def test_shutdown_trigger_ends_a_drain_at_once(echo_model_dir: Path) -> None:
    stop, drain, returned = trio.Event(), trio.Event(), trio.Event()
    frames: list[str] = []

    async def body(c: httpx.AsyncClient, engine: object) -> None:
        first = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stream, c, LONG, "cut-short", frames, first)
            await first.wait()
            drain.set()
            await trio.sleep(0.2)
            assert not returned.is_set()  # 60 s of drain ahead
            with trio.fail_after(15):
                stop.set()
                await returned.wait()
        assert finish_of(frames) == "cancelled"

    await serve_with_triggers(echo_model_dir, ServerConfig(drain_timeout=60), stop, drain, body,
                              returned)


async def test_admin_drain_needs_the_key_and_resumes(echo_model_dir: Path) -> None:
    key = {"Authorization": "Bearer k"}
    async with running_server(echo_model_dir, server=ServerConfig(api_key="k")) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=60, headers=key) as c:
        assert (await c.post("/admin/drain", headers={"Authorization": "Bearer no"})).status_code == 401
        assert (await c.delete("/admin/drain", headers={"Authorization": "Bearer no"})).status_code == 401
        for bad in ("[]", '{"timeout": -1}', '{"timeout": "5"}', '{"timeout": true}', '{"wait": 5}',
                    '{"timeout": 1e999}'):
            r = await c.post("/admin/drain", content=bad, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, bad  # (1e999: the JSON reader refuses it first)
        assert (await c.get("/health")).status_code == 200  # no drain began
        r = await c.post("/admin/drain", json={"timeout": 120})
        assert r.status_code == 202
        assert r.json()["draining"] is True and r.json()["reason"] == "admin"
        assert 119 < r.json()["cancel_in_seconds"] <= 120
        await check_refusals(c, "admin")
        r = await c.delete("/admin/drain")
        assert r.status_code == 200 and r.json() == {"draining": False, "inflight": 0}
        assert (await c.get("/health")).json()["status"] == "ok"
        ok = await c.post(CHAT, json={"messages": [{"role": "user", "content": "back"}]})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "back"
        assert "afm_draining 0" in (await c.get("/metrics")).text


async def test_admin_drain_deadline_cancels_and_the_server_stays(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=60) as c:
        frames: list[str] = []
        first = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stream, c, LONG, "admin-drained", frames, first)
            await first.wait()
            with trio.fail_after(20):
                # default timeout: the server's --drain-timeout (0 here): cancelled at once
                assert (await c.post("/admin/drain")).json()["cancel_in_seconds"] == 0
        assert finish_of(frames) == "cancelled"
        health = (await c.get("/health")).json()
        assert health["status"] == "draining" and health["draining"]["cancel_in_seconds"] == 0
        assert {k: health[k] for k in IDLE} == IDLE
        assert (await c.delete("/admin/drain")).status_code == 200
        assert (await c.get("/health")).status_code == 200


def test_cli_drain_timeout_defaults_to_zero() -> None:
    assert build_parser("serve").parse_args(["serve"]).drain_timeout == 0
    assert build_parser("serve").parse_args(["serve", "--drain-timeout", "30"]).drain_timeout == 30
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--drain-timeout", "-1"])


def test_afm_serve_sigterm_drains_and_a_second_signal_stops(echo_model_dir: Path, tmp_path: Path) -> None:
    """The CLI's wiring: SIGTERM with --drain-timeout drains; a second SIGTERM ends it."""
    server = ReplicaProcess("drain", echo_model_dir, free_port(), tmp_path, ("--drain-timeout", "60"))
    server.start()
    try:
        server.wait_ready()
        frames: list[str] = []
        with httpx.Client(base_url=server.url, timeout=60) as c, \
                c.stream("POST", CHAT, json=LONG) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                frames.append(line[6:])
                if len(frames) == 3:
                    server.signal(signal.SIGTERM)
                    health = httpx.get(server.url + "/health", timeout=10)
                    while health.status_code == 200:  # the signal is handled asynchronously
                        health = httpx.get(server.url + "/health", timeout=10)
                    assert health.json()["status"] == "draining"
                    server.signal(signal.SIGTERM)
        assert finish_of(frames) == "cancelled"
        assert server.wait_exit(30) == 0
        log = server.log()
        assert "SIGTERM: draining" in log and "SIGTERM: shutting down" in log
    finally:
        server.stop()
