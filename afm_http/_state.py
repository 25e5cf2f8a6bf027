"""What one app's routes share: its options and its per-app state.

:class:`ServerConfig` holds the HTTP-layer options (the engine has its own
``EngineConfig``); :class:`AppState` is the one object a route or middleware
reaches for the served models (a route gets its engine with
``async with state.engine_for(choice) as engine``, which holds the model for
the request's life: :mod:`afm_http._registry`), the options, the request ids
open with the engines, the response counts and the Responses API's stored
and running responses.  :func:`current_state` finds it for the request being
handled, so handlers are plain module-level functions.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol, cast

import trio
from quart import current_app

from afm_core import Engine
from afm_core.api.responses import ResponseWriter
from afm_core.api.responses_store import (
    DEFAULT_MAX_AGE,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_RESPONSES,
    ResponseStore,
)

from ._body import MAX_DEPTH
from ._drain import Drain
from ._ids import InFlight
from ._registry import ModelChoice, ModelRegistry

__all__ = ["AppState", "LiveResponse", "ServerConfig", "current_state"]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-layer options (the engine has its own :class:`EngineConfig`)."""

    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 8 << 20
    max_json_depth: int = MAX_DEPTH
    body_timeout: float = 60.0
    responses_store_size: int = DEFAULT_MAX_RESPONSES
    """Finished ``store: true`` Responses kept for GET and ``previous_response_id``
    (the oldest is evicted past it; 0 keeps none)."""
    responses_store_ttl: float = DEFAULT_MAX_AGE
    """Seconds a stored Response is kept (counted from when it finished)."""
    keepalive_seconds: float = 10.0
    """A streaming response silent this long (queued, or in a long prefill) gets an
    SSE comment ``: keepalive`` (Anthropic's route: a ``ping`` event, the Responses
    route: ``response.in_progress`` again); 0 sends none."""
    drain_timeout: float = 0.0
    """Once a drain began (SIGTERM under ``afm serve``, ``POST /admin/drain``), the seconds
    running streams get to finish before the rest are cancelled; on SIGTERM, 0 cancels
    them at once (the behaviour without a drain).  See :mod:`afm_http._drain`."""
    ui: bool = True
    """Serve the chat page at ``GET /`` (``afm serve --no-ui``: off, ``/`` is then 404)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names a request's ``Host`` header may name besides IP addresses, ``localhost``
    and the bound address, when no API key is set (``*``: any; :mod:`afm_http._browser`)."""
    responses_store_bytes: int = DEFAULT_MAX_BYTES
    """Bytes (of their JSON) the stored Responses may hold together; the oldest is evicted past it."""
    stream_write_timeout: float = 30.0
    """A response write the client has not taken for this many seconds (it stopped
    reading) closes the connection, which cancels its request and frees its slot."""
    idle_timeout: float = 30.0
    """Seconds a connection may stay open without a request in progress (between
    requests, or while a request's headers trickle in)."""
    max_connections: int = 1024
    """Open connections at most; at the cap a new one closes the longest-idle one,
    and with none idle is served one request and closed (``/health`` still answers)."""


@dataclass(eq=False, slots=True)
class LiveResponse:
    """A Responses API response being generated (for cancel and GET by its id)."""

    request_id: str
    """The engine request id generating it (the client's ``X-Request-ID`` or a minted one)."""
    writer: ResponseWriter
    done: trio.Event = field(default_factory=trio.Event)
    """Set once the writer has its final status (and the response is stored)."""


@dataclass(eq=False, slots=True)
class AppState:
    """One app's shared state (set by :func:`afm_http.create_app`)."""

    models: ModelRegistry
    """The served models (one, or several with ``afm serve --model A --model B``)."""
    config: ServerConfig
    embedder: Engine | None = None
    """A dedicated embedding model's engine (``--embedding-model``); None: the
    request's model answers ``/v1/embeddings`` itself."""
    inflight: InFlight = field(default_factory=InFlight)
    """Request ids this app has open with the engines (cancelled at shutdown)."""
    draining: Drain = field(default_factory=Drain)
    """Whether this replica is draining (``/health`` 503, new generation requests 503)."""
    statuses: Counter[int] = field(default_factory=Counter)
    """Responses sent, by status code (for ``/metrics``)."""
    responses: ResponseStore = field(init=False)
    """Finished ``store: true`` Responses (bounded by the config's size and TTL)."""
    responses_live: dict[str, LiveResponse] = field(default_factory=dict)
    """Responses API responses in progress, by response id."""
    listen_hosts: frozenset[str] = frozenset()
    """The address(es) the server was bound to (``serve_engine``'s ``host``), for the
    ``Host`` check of :mod:`afm_http._browser`."""

    def engine_for(self, choice: ModelChoice | None = None) -> AbstractAsyncContextManager[Engine]:
        """``async with``: the engine of the model a request chose (loaded if it was
        not), held until the block ends; a 404 ``model_not_found`` for an unknown one."""
        if choice is None:
            return self.models.use()
        return self.models.use(choice.model, choice.keep_alive)

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every engine loaded now: the served models', then the embedding model's if any."""
        loaded = tuple(self.models.engines())
        return loaded if self.embedder is None else (*loaded, self.embedder)

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.config.responses_store_size,
                                       self.config.responses_store_ttl,
                                       max_bytes=self.config.responses_store_bytes)

    def cancel(self, request_id: str) -> bool:
        """Cancel ``request_id`` on whichever model's engine has it."""
        return sum(e.cancel(request_id) for e in self.models.all_engines()) > 0

    def drain(self) -> int:
        """Cancel every request this app has open; each stream ends "cancelled", then [DONE]."""
        return sum(self.cancel(rid) for rid in self.inflight.ids())


class _StateHolder(Protocol):
    """The face of ``afm_http._asgi.AFMQuart`` that :func:`current_state` reads
    (that app class builds on this module, so it is not imported here)."""

    afm_state: AppState


def current_state() -> AppState:
    """The state of the app handling the current request."""
    return cast(_StateHolder, current_app).afm_state
