"""Run the app on hypercorn's trio worker, next to the engine."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import hypercorn.trio.run as _hypercorn_run
import trio
from hypercorn.config import Config
from hypercorn.events import Event, Updated
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer

from afm_core._engine import Engine

from ._app import ServerConfig, create_app

__all__ = ["GRACEFUL_SECONDS", "hypercorn_config", "serve_engine"]

log = logging.getLogger("afm.http")

GRACEFUL_SECONDS = 5.0


class _ReleasingTCPServer(TCPServer):
    """hypercorn's connection handler, releasing connections whose peer is gone.

    When the client closes a keep-alive connection around the end of a
    response (typically right after reading ``[DONE]``), hypercorn 0.18 stops
    reading but (re)arms its keep-alive timer, so the socket sits in
    CLOSE-WAIT with its handler task for ``keep_alive_timeout`` seconds.
    Once the read loop has ended nothing more can arrive: stop the timer, and
    never re-arm it afterwards.
    """

    _reader_done = False

    async def _read_data(self) -> None:
        await super()._read_data()
        self._reader_done = True
        await self.idle_task.stop()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated) and event.idle and self._reader_done:
            return  # the peer is gone: no keep-alive wait
        await super().protocol_send(event)


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


async def serve_engine(engine: Engine, *, host: str = "127.0.0.1", port: int = 9999,
                       server: ServerConfig | None = None,
                       shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
                       quiet: bool = False,
                       task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``engine`` until cancelled or until ``shutdown_trigger()`` returns.

    ``task_status.started`` gets the bound URLs (``port=0`` picks a free port).
    On the trigger, listening stops and every open request is cancelled, so
    streams end with ``finish_reason: "cancelled"`` and ``[DONE]`` instead of
    a cut connection; hypercorn then waits up to ``GRACEFUL_SECONDS``.
    """
    app = create_app(engine, server)
    trigger = None
    if shutdown_trigger is not None:
        user_trigger = shutdown_trigger

        async def trigger() -> None:
            await user_trigger()
            n = app.afm_drain()
            if n:
                log.info("shutdown: cancelled %d open request(s)", n)

    await serve(app, hypercorn_config(host, port, quiet=quiet),  # type: ignore[arg-type]
                shutdown_trigger=trigger, task_status=task_status)
