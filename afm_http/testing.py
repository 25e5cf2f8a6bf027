"""A real server on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from afm_core import Engine, open_engine

from ._server import serve_engine
from ._state import ServerConfig

__all__ = ["running_server"]


@asynccontextmanager
async def running_server(model: str | Path | None, *, server: ServerConfig | None = None,
                         embedder: Engine | None = None,
                         **engine_config: Any) -> AsyncIterator[tuple[str, Engine]]:
    """``(base_url, engine)`` of a hypercorn server on ``127.0.0.1:<free port>`` serving ``model``.

    ``engine_config`` goes to :func:`open_engine` (``max_batch=1``, ``grammar=False`` ...);
    ``embedder`` (an open engine) answers ``/v1/embeddings``, as ``--embedding-model``.
    Leaving the block stops the server (open connections are cut) and the engine.
    """
    async with open_engine(model, **engine_config) as engine, trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve_engine(
            engine, host="127.0.0.1", port=0, server=server or ServerConfig(), quiet=True,
            embedder=embedder, task_status=task_status))
        try:
            yield binds[0], engine
        finally:
            nursery.cancel_scope.cancel()
