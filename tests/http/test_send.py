"""The server's direct socket writes (afm_http._server._ReleasingTCPServer) keep
every write whole and in order, and leave errors to hypercorn's path."""

from __future__ import annotations

import socket

import trio
from hypercorn.events import Closed, RawData

from afm_http._server import _ReleasingTCPServer


class _Protocol:
    def __init__(self) -> None:
        self.events: list[object] = []

    async def handle(self, event: object) -> None:
        self.events.append(event)


def _server(stream: trio.SocketStream) -> _ReleasingTCPServer:
    # only what protocol_send touches: the stream, the lock, the protocol
    srv = object.__new__(_ReleasingTCPServer)
    srv.stream = stream
    srv.send_lock = trio.Lock()
    srv.protocol = _Protocol()  # type: ignore[assignment]
    return srv


async def _pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return trio.SocketStream(a), trio.SocketStream(b)


async def test_writes_stay_whole_and_ordered_when_the_socket_fills() -> None:
    ours, peer = await _pair()
    srv = _server(ours)
    size = 200_000  # far beyond the send buffer: partial writes and waits
    received = bytearray()

    async def writer(first: int) -> None:
        for i in (first, first + 1):
            await srv.protocol_send(RawData(data=bytes([i]) * size))

    async def reader() -> None:
        while len(received) < 6 * size:
            received.extend(await peer.receive_some(7000))
            await trio.lowlevel.checkpoint()  # a slow client

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            for first in (1, 3, 5):
                nursery.start_soon(writer, first)
    runs = [received[k:k + size] for k in range(0, len(received), size)]
    assert len(runs) == 6
    # every write arrived contiguous, each writer's two writes in order
    values = [run[0] for run in runs]
    assert all(run == bytes([v]) * size for run, v in zip(runs, values, strict=True))
    assert sorted(values) == [1, 2, 3, 4, 5, 6]
    for first in (1, 3, 5):
        assert values.index(first) < values.index(first + 1)
    assert srv.protocol.events == []  # type: ignore[attr-defined]


async def test_small_writes_go_out_at_once() -> None:
    ours, peer = await _pair()
    srv = _server(ours)
    assert srv._send_now(b"data: x\n\n") == b""
    assert await peer.receive_some(100) == b"data: x\n\n"
    async with srv.send_lock:  # another send in progress: wait for hypercorn's path
        assert srv._send_now(b"y") == b"y"


async def test_a_closed_peer_is_reported_by_hypercorns_path() -> None:
    ours, peer = await _pair()
    srv = _server(ours)
    await peer.aclose()
    with trio.fail_after(10):
        for _ in range(3):  # the first write may still land in the kernel buffer
            await srv.protocol_send(RawData(data=b"z" * 10_000))
    assert any(isinstance(e, Closed) for e in srv.protocol.events)  # type: ignore[attr-defined]
