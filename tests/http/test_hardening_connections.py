"""Issue 31, cases 2 and 3: clients that do not read, and sockets that do nothing.

Case 2: with ``--max-batch 4 --max-waiting 4``, eight streamed requests whose
clients never read held every slot for as long as their sockets stayed open
(every other client got 503).  Now a write the client takes nothing of for
``stream_write_timeout`` seconds closes its connection, which cancels the
request and frees its slot.

Case 3: about 2,100 connections with half-sent headers hit the process's
open-file limit (``accept`` failed with ``EMFILE``) and ``/health`` timed out
for everyone.  Now the process raises its soft limit at start, keeps at most
``max_connections`` (below the limit), and a new connection closes the
longest-idle one, so ``/health`` is answered; idle sockets are closed after
``idle_timeout``.  Real sockets throughout; the limit case runs ``afm serve``
in a child process whose open-file limit is pinned low.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import httpx
import pytest
import trio

from afm_http import ServerConfig
from afm_http._connections import ConnectionTable
from afm_http.testing import running_server
from tests.process import LoggedProcess

CHAT = "/v1/chat/completions"
LONG = " ".join(f"w{i}" for i in range(5000))  # the echo model says it back: ~1 MB of SSE


def _request(port: int, body: dict, path: str = CHAT) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def _dechunked(response: bytes) -> bytes:
    """The body of an HTTP/1.1 response in chunked transfer encoding."""
    body = response.split(b"\r\n\r\n", 1)[1]
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out += rest[:n]
        body = rest[n + 2:]
    return out


async def _unread_stream(port: int, text: str = LONG) -> trio.SocketStream:
    """A connection that sends a long streamed request and reads nothing (yet)."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a full window soon
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    await stream.send_all(_request(port, {"messages": [{"role": "user", "content": text}], "stream": True}))
    return stream


async def test_unread_streams_are_cancelled_and_free_their_slots(echo_model_dir: Path) -> None:
    cfg = ServerConfig(stream_write_timeout=1.0)
    async with running_server(echo_model_dir, server=cfg, max_batch=4, max_waiting=4) as (url, engine), \
            httpx.AsyncClient(base_url=url, timeout=60) as c:
        port = int(url.rsplit(":", 1)[1])
        stuck = [await _unread_stream(port) for _ in range(8)]
        with trio.fail_after(60):
            while engine.statistics().requests_active < 8:
                await trio.sleep(0.05)
        assert (await c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})).status_code == 503
        # nobody reads: each stream's writes stall, time out, and its request ends
        with trio.fail_after(60):
            while engine.statistics().requests_active:
                await trio.sleep(0.1)
        r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "after"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "after"
        for s in stuck:  # the server closed them: what was sent, then the end
            with trio.fail_after(30):
                while await s.receive_some(1 << 20):
                    pass
            await s.aclose()


async def test_a_slow_reader_that_keeps_reading_is_served_in_full(echo_model_dir: Path) -> None:
    """The timeout is on progress, not on the whole response: a client reading a
    little at a time, more often than the timeout, gets every byte."""
    cfg = ServerConfig(stream_write_timeout=1.0)
    async with running_server(echo_model_dir, server=cfg) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        said = LONG[:12000]  # ~2,000 words: ~400 KB of SSE through a 4 KB window
        s = await _unread_stream(port, said)
        got = b""
        with trio.fail_after(300):
            while b"data: [DONE]" not in got:
                await trio.sleep(0.1)  # each read frees a few KB: writes wait, but move
                chunk = await s.receive_some(16384)
                assert chunk, "the server closed a connection that was reading"
                got += chunk
        await s.aclose()
        events = [json.loads(frame[6:]) for frame in _dechunked(got).decode().split("\n\n")
                  if frame.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        assert text == said


async def test_idle_connections_give_way_and_are_closed(echo_model_dir: Path) -> None:
    cfg = ServerConfig(max_connections=40, idle_timeout=2.0)
    async with running_server(echo_model_dir, server=cfg) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        idle = []
        for _ in range(150):  # half-sent headers, as a slowloris
            s = await trio.open_tcp_stream("127.0.0.1", port)
            await s.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            idle.append(s)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"
            r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "still"}]})
            assert r.json()["choices"][0]["message"]["content"] == "still"
        for s in idle:  # every one is closed: evicted, or after the idle timeout
            with trio.fail_after(30):
                try:
                    while await s.receive_some(4096):
                        pass
                except trio.BrokenResourceError:
                    pass  # (reset: closed with the request unread)
            await s.aclose()


@pytest.mark.parametrize(("limit", "sockets"), [(4096, 2200), (400, 600)])
def test_health_answers_at_the_open_file_limit(echo_model_dir: Path, limit: int, sockets: int) -> None:
    """``afm serve`` with its open-file limit pinned (soft and hard, so it cannot
    go past it; mlx-lm's own import used to set 2048 and crash below 4096):
    thousands of half-sent connections, then ``/health`` and a chat."""
    shim = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
            "os.execv(sys.executable, [sys.executable, '-m', 'afm_core._cli'] + sys.argv[1:])")
    server = LoggedProcess([sys.executable, "-c", shim, "serve", "--quiet", "--port", "0", "--no-warmup",
                            "--no-ui", "--model", str(echo_model_dir), "--idle-timeout", "60"])
    socks: list[socket.socket] = []
    try:
        found = server.wait_for(r"serving .* on (http://127\.0\.0\.1:(\d+))", timeout=120)
        assert found, server.log()
        url, port = found.group(1), int(found.group(2))
        for _ in range(sockets):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            try:
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            except OSError:
                pass  # already closed to make room
            socks.append(s)
        r = httpx.get(url + "/health", timeout=20)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "served"}]}, timeout=20)
        assert r.json()["choices"][0]["message"]["content"] == "served"
    finally:
        for s in socks:
            s.close()
        server.kill()


def test_connection_table() -> None:
    t: ConnectionTable[str] = ConnectionTable(2)
    assert t.admit("a") == ("serve", None) and t.admit("b") == ("serve", None)
    t.mark("a", False)  # a request in progress on a
    assert t.admit("c") == ("serve", "b")  # b idle longest: closed for c
    t.mark("c", False)
    assert t.admit("d") == ("overflow", None)  # nobody idle: beyond the cap
    t.mark("a", True)
    assert t.admit("e") == ("overflow", "d")  # d idle longest (since its start), then a
    assert len(t) == 3 and t.evicted == 2
    t.release("a")
    assert len(t) == 2
    t.release("zz")  # unknown: nothing
    with pytest.raises(ValueError):
        ConnectionTable(0)
    full: ConnectionTable[int] = ConnectionTable(1)
    for i in range(1 + 32):
        full.admit(i)
        full.mark(i, False)
    assert full.admit(99) == ("refuse", None) and full.refused == 1
