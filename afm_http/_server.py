"""Run the app on hypercorn's trio worker, next to the engine."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any

import hypercorn.trio.run as _hypercorn_run
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer

from afm_core import Engine

from ._app import create_app
from ._connections import ConnectionTable, connection_cap
from ._registry import ModelRegistry
from ._state import AppState, ServerConfig

__all__ = ["GRACEFUL_SECONDS", "ServingConfig", "hypercorn_config", "serve_engine"]

log = logging.getLogger("afm.http")

GRACEFUL_SECONDS = 5.0


class ServingConfig(Config):
    """hypercorn's settings, with what afm's connection handler adds: the
    write timeout and the table of open connections (:mod:`._connections`)."""

    afm_write_timeout: float = math.inf
    afm_connections: ConnectionTable[Any] | None = None


class _ReleasingTCPServer(TCPServer):
    """hypercorn's connection handler, releasing connections whose peer is
    gone and writing without a detour when the socket can take the bytes.

    When the client closes a keep-alive connection around the end of a
    response (typically right after reading ``[DONE]``), hypercorn 0.18 stops
    reading but (re)arms its keep-alive timer, so the socket sits in
    CLOSE-WAIT with its handler task for ``keep_alive_timeout`` seconds.
    Once the read loop has ended nothing more can arrive: stop the timer, and
    never re-arm it afterwards.

    Every SSE write (one per stream per engine step) goes through hypercorn's
    send lock and Trio's ``send_all``, which pass through the scheduler two or
    three times even when the socket has room.  When no other send is in
    progress, :meth:`_send_now` writes at once; whatever the socket does not
    take (a full buffer, a slow reader), and every error, goes on through
    the locked path, in order, after it.

    A write the client does not take within ``ServingConfig.afm_write_timeout``
    seconds (it stopped reading, and the socket's buffers are full) closes the
    connection: the app sees the client gone, which cancels its request and
    frees its batch slot, instead of the write waiting as long as the socket
    stays open.  And the connection is counted in the server's
    :class:`~afm_http._connections.ConnectionTable`, which may close it to
    make room while it is idle.
    """

    _reader_done = False
    _tails = 0  # writes handed to the locked path and not finished
    _table: ConnectionTable[Any] | None = None

    async def run(self) -> None:
        table: ConnectionTable[Any] | None = getattr(self.config, "afm_connections", None)
        if table is None:
            await super().run()
            return
        admission, victim = table.admit(self)
        if victim is not None:
            await victim.evict()
        if admission == "refuse":
            with trio.CancelScope(shield=True):
                await self.stream.aclose()
            return
        self._table = table
        try:
            await super().run()
        finally:
            table.release(self)

    async def evict(self) -> None:
        """Close this (idle) connection to make room for another."""
        with trio.CancelScope(shield=True):
            if hasattr(self, "protocol"):
                await self.protocol.handle(Closed())
            await self.stream.aclose()

    async def _read_data(self) -> None:
        await super()._read_data()
        self._reader_done = True
        await self.idle_task.stop()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData) and event.address is None:
            rest = self._send_now(event.data)
            if rest:
                # until this tail is out, later writes queue behind it (HTTP/2
                # streams send from several tasks; trio's lock is FIFO)
                self._tails += 1
                try:
                    await self._send_locked(rest)
                finally:
                    self._tails -= 1
            return
        if isinstance(event, Updated) and self._table is not None:
            self._table.mark(self, event.idle)
        if isinstance(event, Updated) and event.idle and self._reader_done:
            return  # the peer is gone: no keep-alive wait
        await super().protocol_send(event)

    async def _send_locked(self, data: bytes) -> None:
        """hypercorn's write (under the send lock, shielded: a write is never
        cut by a cancelled request), bounded by the write timeout."""
        timeout = getattr(getattr(self, "config", None), "afm_write_timeout", math.inf)
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True):
                    stuck = not await self._send_with_progress(data, timeout)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                stuck = False
            else:
                if not stuck:
                    return
                log.info("closing a connection whose client took nothing for %g s (%s)",
                         timeout, self.protocol.client if hasattr(self, "protocol") else "?")
                with trio.CancelScope(shield=True):
                    await self.stream.aclose()  # under the lock: no later write waits on it
        with trio.CancelScope(shield=True):
            await self.protocol.handle(Closed())

    async def _send_with_progress(self, data: bytes, seconds: float) -> bool:
        """Send ``data``; False when ``seconds`` passed with no byte taken (a
        client reading slowly still gets everything, however long it takes)."""
        stream = self.stream
        if type(stream) is not trio.SocketStream:
            with trio.move_on_after(seconds):
                await stream.send_all(data)
                return True
            return False
        sock = stream.socket
        view = memoryview(data)
        while view:
            with trio.move_on_after(seconds):
                sent = await sock.send(view)
                view = view[sent:]
                continue
            return False
        return True

    def _send_now(self, data: bytes) -> bytes:
        """Write what the socket takes right now; return the rest."""
        stream = self.stream
        if self._tails or self.send_lock.locked() or type(stream) is not trio.SocketStream or not data:
            return data
        try:
            sent = os.write(stream.socket.fileno(), data)
        except OSError:  # full (BlockingIOError) or broken: hypercorn's path decides
            return data
        return data[sent:]


# hypercorn's trio worker looks the handler class up in this module at serve time
_hypercorn_run.TCPServer = _ReleasingTCPServer  # type: ignore[misc]


def hypercorn_config(host: str = "127.0.0.1", port: int = 9999, *, quiet: bool = False,
                     server: ServerConfig | None = None) -> ServingConfig:
    """Hypercorn settings for one HTTP/1.1 + h2c listener on ``host:port``, with
    ``server``'s connection limits (``idle_timeout``, ``stream_write_timeout``,
    ``max_connections``; the defaults without one)."""
    server = server or ServerConfig()
    config = ServingConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.keep_alive_timeout = server.idle_timeout
    config.afm_write_timeout = server.stream_write_timeout if server.stream_write_timeout > 0 else math.inf
    config.afm_connections = ConnectionTable(connection_cap(server.max_connections))
    config.graceful_timeout = GRACEFUL_SECONDS
    # through logging (one line each; the embedder configures handlers)
    config.accesslog = None if quiet else logging.getLogger("hypercorn.access")
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


async def serve_engine(engine: Engine | ModelRegistry, *, host: str = "127.0.0.1", port: int = 9999,
                       server: ServerConfig | None = None,
                       shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
                       drain_trigger: Callable[[], Awaitable[Any]] | None = None,
                       quiet: bool = False,
                       embedder: Engine | None = None,
                       task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``engine`` (or a running registry's models) until cancelled or until a trigger ends it.

    ``task_status.started`` gets the bound URLs (``port=0`` picks a free port).
    When ``shutdown_trigger()`` returns, listening stops and every open request
    is cancelled, so streams end with ``finish_reason: "cancelled"`` and
    ``[DONE]`` instead of a cut connection; hypercorn then waits up to
    ``GRACEFUL_SECONDS``.  When ``drain_trigger()`` returns, the server drains
    first (:mod:`afm_http._drain`: ``/health`` 503, new generation requests 503)
    until its open requests ended or ``server.drain_timeout`` seconds passed,
    then shuts down the same way; ``shutdown_trigger`` still ends a drain at
    once.  An admin drain (``POST /admin/drain``) has its deadline kept here too.
    """
    app = create_app(engine, server, embedder=embedder)
    state = app.afm_state
    state.listen_hosts = frozenset({host})
    trigger = None
    if shutdown_trigger is not None or drain_trigger is not None:

        async def trigger() -> None:
            async with trio.open_nursery() as nursery:
                if shutdown_trigger is not None:
                    nursery.start_soon(_then_cancel, shutdown_trigger, nursery.cancel_scope)
                if drain_trigger is not None:
                    nursery.start_soon(_drain_then_cancel, drain_trigger, state, nursery.cancel_scope)
            n = app.afm_drain()
            if n:
                log.info("shutdown: cancelled %d open request(s)", n)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(state.draining.enforce, state.drain)
        await serve(app, hypercorn_config(host, port, quiet=quiet, server=state.config),  # type: ignore[arg-type]
                    shutdown_trigger=trigger, task_status=task_status)
        nursery.cancel_scope.cancel()


async def _then_cancel(wait: Callable[[], Awaitable[Any]], scope: trio.CancelScope) -> None:
    await wait()
    scope.cancel()


async def _drain_then_cancel(wait: Callable[[], Awaitable[Any]], state: AppState,
                             scope: trio.CancelScope) -> None:
    await wait()
    state.draining.start(state.config.drain_timeout, "shutdown")
    with trio.move_on_at(state.draining.deadline):
        await state.inflight.wait_empty()
    scope.cancel()
