"""A lean HTTP/1.1 client for the load generator: h11 over Trio sockets.

The load generator shares the machine with the servers it measures, so its
own CPU is taken from them.  httpx spends about 190 µs of CPU per streamed
SSE frame (mostly in httpcore's connection and pool machinery), this client
about 110 (``benchmarks/loadgen_client.py`` measures both).  It does what a
benchmark needs and nothing else: POST a body, read the status, stream the
body's bytes, keep connections alive between requests.

Errors are :class:`ConnectError` (nothing accepted the connection) and
:class:`TransportError` (the connection failed or the server broke HTTP).  A
request on a reused keep-alive connection that fails before any byte of the
response arrived is sent again once on a fresh connection (the server may
have closed the idle connection in between, as every HTTP client allows for).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import cast
from urllib.parse import urlsplit

import h11
import trio

from ._errors import ConnectError, HTTPClientError, TransportError

__all__ = ["Client", "ConnectError", "HTTPClientError", "Response", "TransportError", "read_request"]

READ_SIZE = 65536


_BROKEN = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError)


class _Connection:
    """One HTTP/1.1 connection: a socket stream and its h11 state."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.requests = 0  # sent on this connection so far
        self.received = 0  # bytes of the current response so far

    async def next_event(self) -> h11.Event | type[h11.PAUSED]:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return cast("h11.Event | type[h11.PAUSED]", event)
            data = await self.stream.receive_some(READ_SIZE)
            self.received += len(data)
            self.h11.receive_data(data)

    async def request(self, request: h11.Request, body: bytes) -> h11.Response:
        """Send a request; the response's head."""
        self.requests += 1
        self.received = 0
        h = self.h11
        await self.stream.send_all(h.send(request) + h.send(h11.Data(data=body)) + h.send(h11.EndOfMessage()))
        event = await self.next_event()
        if not isinstance(event, h11.Response):
            raise h11.RemoteProtocolError(f"no response: {event!r}")
        return event

    def reusable(self) -> bool:
        """After a complete exchange: ready for the next request (else close it)."""
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class Response:
    """The status line and headers of an answer; its body is read from here."""

    def __init__(self, conn: _Connection, head: h11.Response) -> None:
        self._conn = conn
        self.status_code = head.status_code
        self.headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in head.headers]
        self.complete = False

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked transfer coding removed)."""
        while not self.complete:
            try:
                event = await self._conn.next_event()
            except _BROKEN as exc:
                raise TransportError(f"{type(exc).__name__}: {exc}") from None
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self.complete = True
            else:  # ConnectionClosed before the end of the message
                raise TransportError("the server closed the connection in the middle of the body")

    async def read(self, limit: int | None = None) -> bytes:
        """The body (its first ``limit`` bytes; the rest is discarded)."""
        parts: list[bytes] = []
        size = 0
        async for data in self.iter_bytes():
            if limit is None or size < limit:
                parts.append(data)
                size += len(data)
        body = b"".join(parts)
        return body if limit is None else body[:limit]


class Client:
    """Keep-alive connections to one loopback server, at most ``max_connections``
    open at once (callers do not wait for one: the load generator sizes it)."""

    def __init__(self, base_url: str, *, max_connections: int) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the load generator speaks plain http to a host, not {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self._authority = parts.netloc.rpartition("@")[2]
        self._idle: list[_Connection] = []
        self._max_idle = max_connections

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()

    @asynccontextmanager
    async def post(self, path: str, body: bytes,
                   headers: Sequence[tuple[str, str]] = ()) -> AsyncIterator[Response]:
        """Send ``body``; yields the response once its head arrived."""
        request = h11.Request(method="POST", target=path, headers=[
            ("Host", self._authority), ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))), *headers])
        while True:
            conn = self._idle.pop() if self._idle else await self._connect()
            try:
                head = await conn.request(request, body)
                break
            except _BROKEN as exc:
                await conn.aclose()
                if conn.requests > 1 and conn.received == 0:
                    continue  # closed while idle: send it again on a new connection
                raise TransportError(f"{type(exc).__name__}: {exc}") from None
            except BaseException:
                await conn.aclose()
                raise
        response = Response(conn, head)
        try:
            yield response
        finally:
            if response.complete and conn.reusable() and len(self._idle) < self._max_idle:
                self._idle.append(conn)
            else:
                await conn.aclose()

    async def _connect(self) -> _Connection:
        try:
            stream = await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:
            raise ConnectError(f"{self.host}:{self.port}: {exc}") from None
        return _Connection(stream)


async def read_request(stream: trio.abc.ReceiveStream,
                       buf: bytearray) -> tuple[dict[str, str], bytes] | None:
    """The server side, for the stub servers of tests and benchmarks: the next
    request's headers (lower-case names, plus ``:request-line``) and body, or
    None when the peer closed first.  ``buf`` carries bytes read past the
    request over to the next call on the same connection."""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(READ_SIZE)
        if not data:
            return None
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    headers[":request-line"] = lines[0]
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        data = await stream.receive_some(READ_SIZE)
        if not data:
            return None
        rest += data
    del buf[:]
    buf += rest[length:]
    return headers, rest[:length]
