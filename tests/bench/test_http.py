"""The load generator's HTTP/1.1 client against scripted loopback servers:
keep-alive reuse, a connection closed while idle, broken answers, and the
error kinds the load generator reports for them."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio

import afm_core.bench as bench
from afm_core.bench._errors import ConnectError, TransportError
from afm_core.bench._http import Client, read_request
from afm_core.bench._loadgen import Target
from afm_core.bench._workload import make_workload

Reply = Callable[[trio.SocketStream, dict[str, str], bytes], Awaitable[bool]]


async def _serve(nursery: trio.Nursery, reply: Reply) -> tuple[int, list[int]]:
    """A loopback server answering each request with ``reply`` (which returns
    whether to keep the connection); also the count of requests per connection."""
    per_connection: list[int] = []

    async def handle(stream: trio.SocketStream) -> None:
        n = len(per_connection)
        per_connection.append(0)
        buf = bytearray()
        async with stream:
            while (req := await read_request(stream, buf)) is not None:
                per_connection[n] += 1
                if not await reply(stream, *req):
                    return

    listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1]), per_connection


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _sse(n_tokens: int) -> list[bytes]:
    frames = [json.dumps({"choices": [{"delta": {"content": f"t{i}"}, "finish_reason": None}]})
              for i in range(n_tokens)]
    frames.append(json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n_tokens}}))
    frames.append("[DONE]")
    return [f"data: {f}\n\n".encode() for f in frames]


async def _sse_reply(stream: trio.SocketStream, headers: dict[str, str], body: bytes) -> bool:
    await stream.send_all(SSE_HEAD)
    for part in _sse(json.loads(body)["max_tokens"]):  # one chunk per frame, as servers stream
        await stream.send_all(b"%x\r\n%s\r\n" % (len(part), part))
    await stream.send_all(b"0\r\n\r\n")
    return True


async def test_posts_stream_and_keep_the_connection_alive() -> None:
    seen: list[tuple[dict[str, str], bytes]] = []

    async def reply(stream: trio.SocketStream, headers: dict[str, str], body: bytes) -> bool:
        seen.append((headers, body))
        await stream.send_all(SSE_HEAD + _chunked(b"data: a\n\n", b"data: b\n\n"))
        return True

    async with trio.open_nursery() as nursery:
        port, conns = await _serve(nursery, reply)
        async with Client(f"http://127.0.0.1:{port}", max_connections=2) as client:
            for i in range(3):
                async with client.post("/v1/chat/completions", b'{"i":%d}' % i,
                                       [("X-AFM-Profile", "extended")]) as resp:
                    assert resp.status_code == 200
                    assert ("content-type", "text/event-stream") in resp.headers
                    assert b"".join([b async for b in resp.iter_bytes()]) == b"data: a\n\ndata: b\n\n"
        nursery.cancel_scope.cancel()
    assert conns == [3]  # one connection carried all three
    headers, body = seen[2]
    assert headers[":request-line"] == "POST /v1/chat/completions HTTP/1.1"
    assert headers["host"] == f"127.0.0.1:{port}" and headers["x-afm-profile"] == "extended"
    assert headers["content-type"] == "application/json" and body == b'{"i":2}'


async def test_a_connection_closed_while_idle_is_replaced() -> None:
    async def reply(stream: trio.SocketStream, headers: dict[str, str], body: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return False  # keep-alive promised, closed anyway (an idle timeout)

    async with trio.open_nursery() as nursery:
        port, conns = await _serve(nursery, reply)
        async with Client(f"http://127.0.0.1:{port}", max_connections=1) as client:
            for _ in range(3):
                async with client.post("/", b"{}") as resp:
                    assert await resp.read() == b"ok"
                await trio.sleep(0.05)  # let the close arrive before the next request
        nursery.cancel_scope.cancel()
    assert conns == [1, 1, 1]


async def test_a_close_delimited_body_ends_the_connection() -> None:
    async def reply(stream: trio.SocketStream, headers: dict[str, str], body: bytes) -> bool:
        await stream.send_all(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: x\n\n")
        return False

    async with trio.open_nursery() as nursery:
        port, conns = await _serve(nursery, reply)
        async with Client(f"http://127.0.0.1:{port}", max_connections=1) as client:
            for _ in range(2):
                async with client.post("/", b"{}") as resp:
                    assert await resp.read() == b"data: x\n\n"
        nursery.cancel_scope.cancel()
    assert conns == [1, 1]


@pytest.mark.parametrize("answer", [
    SSE_HEAD + b"9\r\ndata: x\n\n\r\n",  # closed inside a chunked body
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",  # closed before Content-Length
    b"SSH-2.0-OpenSSH_9.6\r\n\r\n",  # not HTTP
    b"",  # closed without a word
])
async def test_broken_answers_are_transport_errors(answer: bytes) -> None:
    async def reply(stream: trio.SocketStream, headers: dict[str, str], body: bytes) -> bool:
        await stream.send_all(answer)
        return False

    async with trio.open_nursery() as nursery:
        port, _ = await _serve(nursery, reply)
        async with Client(f"http://127.0.0.1:{port}", max_connections=1) as client:
            with pytest.raises(TransportError):
                async with client.post("/", b"{}") as resp:
                    await resp.read()
        run = await bench.run_closed(Target("stub", f"http://127.0.0.1:{port}"), make_workload(0, 2),
                                     1, 2, level_timeout=10, request_timeout=5)
        nursery.cancel_scope.cancel()
    assert [r.error for r in run.requests] == ["transport", "transport"]
    assert all(r.detail for r in run.requests)


async def test_error_status_keeps_its_body_as_the_detail() -> None:
    async def reply(stream: trio.SocketStream, headers: dict[str, str], body: bytes) -> bool:
        text = json.dumps({"error": {"message": "busy", "type": "server_error"}}).encode() * 20
        await stream.send_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s"
                              % (len(text), text))
        return True

    async with trio.open_nursery() as nursery:
        port, conns = await _serve(nursery, reply)
        run = await bench.run_closed(Target("stub", f"http://127.0.0.1:{port}"), make_workload(0, 3),
                                     1, 3, level_timeout=10, request_timeout=5)
        nursery.cancel_scope.cancel()
    assert [r.error for r in run.requests] == ["http_503"] * 3
    assert all(r.detail and r.detail.startswith('{"error": {"message": "busy"') and len(r.detail) == 200
               for r in run.requests)
    assert conns == [3]  # the whole body was read, so the connection stayed usable


async def test_load_generator_over_one_keep_alive_connection_per_stream() -> None:
    wl = make_workload(0, 12, max_tokens=(2, 5))
    async with trio.open_nursery() as nursery:
        port, conns = await _serve(nursery, _sse_reply)
        run = await bench.run_closed(Target("stub", f"http://127.0.0.1:{port}"), wl, 3, 12,
                                     level_timeout=30, request_timeout=10)
        nursery.cancel_scope.cancel()
    assert all(r.ok for r in run.requests), [(r.error, r.detail) for r in run.requests]
    assert [r.output_tokens for r in run.requests] == [j.max_tokens for j in wl.jobs]
    assert len(conns) == 3 and sum(conns) == 12


async def test_nothing_listening_is_a_connect_error() -> None:
    from afm_core.bench._servers import free_port

    async with Client(f"http://127.0.0.1:{free_port()}", max_connections=1) as client:
        with pytest.raises(ConnectError):
            async with client.post("/", b"{}"):
                pass


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError):
        Client("https://127.0.0.1:8443", max_connections=1)
    with pytest.raises(ValueError):
        Client("127.0.0.1:8000", max_connections=1)
