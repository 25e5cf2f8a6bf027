"""Run the app on hypercorn's trio worker, next to the engine."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import hypercorn.trio.run as _hypercorn_run
import trio
from hypercorn.config import Config
from hypercorn.events import Event, RawData, Updated
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer

from afm_core import Engine

from ._app import create_app
from ._registry import ModelRegistry
from ._state import AppState, ServerConfig

__all__ = ["GRACEFUL_SECONDS", "hypercorn_config", "serve_engine"]

log = logging.getLogger("afm.http")

GRACEFUL_SECONDS = 5.0


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
    hypercorn's own path, in order, after it.
    """

    _reader_done = False
    _tails = 0  # writes handed to hypercorn's path and not finished

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
                    await super().protocol_send(RawData(data=rest))
                finally:
                    self._tails -= 1
            return
        if isinstance(event, Updated) and event.idle and self._reader_done:
            return  # the peer is gone: no keep-alive wait
        await super().protocol_send(event)

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


def hypercorn_config(host: str = "127.0.0.1", port: int = 9999, *, quiet: bool = False) -> Config:
    """Hypercorn settings for one HTTP/1.1 + h2c listener on ``host:port``."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.keep_alive_timeout = 75
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
        await serve(app, hypercorn_config(host, port, quiet=quiet),  # type: ignore[arg-type]
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
