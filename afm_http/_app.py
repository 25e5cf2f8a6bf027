"""The app: options, shared state, middleware and the routes, assembled.

The routes live in :mod:`afm_http._routes` (one module per API surface);
the hooks every route shares (request ids, auth, CORS, the error envelope)
in :mod:`afm_http._middleware`; what they share at run time in one
:class:`~afm_http._state.AppState`.
"""

from __future__ import annotations

from afm_core import Engine

from ._asgi import AFMQuart
from ._middleware import install
from ._routes import ROUTES
from ._state import AppState, ServerConfig

__all__ = ["ServerConfig", "create_app"]


def create_app(engine: Engine, config: ServerConfig | None = None, *,
               embedder: Engine | None = None) -> AFMQuart:
    """The ASGI app serving ``engine`` (run it with hypercorn's trio worker);
    ``embedder``, when given, answers ``/v1/embeddings`` instead of ``engine``
    (``afm serve --embedding-model``)."""
    cfg = config or ServerConfig()
    app = AFMQuart("afm")
    app.config.update(
        MAX_CONTENT_LENGTH=cfg.max_body_bytes,
        RESPONSE_TIMEOUT=None,
        BODY_TIMEOUT=cfg.body_timeout,
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    app.afm_state = AppState(engine, cfg, embedder=embedder)
    install(app)
    for register in ROUTES:
        register(app)
    return app
