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
from ._registry import ModelRegistry
from ._routes import ROUTES
from ._state import AppState, ServerConfig

__all__ = ["ServerConfig", "create_app"]


def create_app(engine: Engine | ModelRegistry, config: ServerConfig | None = None, *,
               embedder: Engine | None = None) -> AFMQuart:
    """The ASGI app serving ``engine`` (run it with hypercorn's trio worker), or
    the models of a running :class:`~afm_http._registry.ModelRegistry`
    (``afm serve --model A --model B``); ``embedder``, when given, answers
    ``/v1/embeddings`` instead (``afm serve --embedding-model``)."""
    cfg = config or ServerConfig()
    models = engine if isinstance(engine, ModelRegistry) else ModelRegistry.serving(engine)
    app = AFMQuart("afm")
    app.config.update(
        MAX_CONTENT_LENGTH=cfg.max_body_bytes,
        RESPONSE_TIMEOUT=None,
        BODY_TIMEOUT=cfg.body_timeout,
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    app.afm_state = AppState(models, cfg, embedder=embedder)
    install(app)
    for register in ROUTES:
        register(app)
    return app
