"""A real server on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from afm_core import Engine, EngineConfig, open_engine

from ._registry import ModelRegistry, ModelSpec, Opener, model_spec, open_models
from ._residency import FOREVER
from ._server import serve_engine
from ._state import ServerConfig

__all__ = ["running_models", "running_server"]


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


@asynccontextmanager
async def running_models(models: Sequence[str | Path | ModelSpec], *, server: ServerConfig | None = None,
                         keep_alive: float = FOREVER, max_loaded_bytes: int | None = None,
                         strict: bool | None = None, pinned: bool = False,
                         preload: Sequence[str] = (), opener: Opener | None = None,
                         **engine_config: Any) -> AsyncIterator[tuple[str, ModelRegistry]]:
    """``(base_url, registry)`` of a server on ``127.0.0.1:<free port>`` serving
    several models, as ``afm serve --model A --model B``: each loads on first
    use (``preload``: these ids first) and unloads once idle for ``keep_alive``
    seconds or when ``max_loaded_bytes`` needs room.  ``engine_config`` is every
    model's :class:`EngineConfig`; ``opener`` replaces ``open_engine``."""
    specs = [m if isinstance(m, ModelSpec) else model_spec(m) for m in models]
    async with open_models(specs, config=EngineConfig(**engine_config), keep_alive=keep_alive,
                           max_loaded_bytes=max_loaded_bytes, strict=strict, pinned=pinned,
                           preload=preload, opener=opener) as registry, trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve_engine(
            registry, host="127.0.0.1", port=0, server=server or ServerConfig(), quiet=True,
            task_status=task_status))
        try:
            yield binds[0], registry
        finally:
            nursery.cancel_scope.cancel()
