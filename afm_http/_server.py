"""Run the app on hypercorn's trio worker, next to the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from afm_core._engine import Engine

from ._app import ServerConfig, create_app


def hypercorn_config(host: str, port: int, *, quiet: bool = False) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.keep_alive_timeout = 75
    config.graceful_timeout = 3
    config.accesslog = None if quiet else "-"
    config.errorlog = "-"
    return config


async def serve_engine(engine: Engine, *, host: str, port: int, server: ServerConfig,
                       shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
                       quiet: bool = False,
                       task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    app = create_app(engine, server)
    await serve(app, hypercorn_config(host, port, quiet=quiet),  # type: ignore[arg-type]
                shutdown_trigger=shutdown_trigger, task_status=task_status)
