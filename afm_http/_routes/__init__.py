"""The HTTP routes, one module per API surface.

Each module has module-level handlers (they find the engine and options
through :func:`afm_http._state.current_state`) and a ``register(app)`` that
adds its URL rules.  A new API is a new module here plus one entry in
:data:`ROUTES`; the middleware (ids, auth, CORS, error envelope) applies to
it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

from .._asgi import AFMQuart
from . import cancel, chat, health, models

__all__ = ["ROUTES"]

ROUTES: tuple[Callable[[AFMQuart], None], ...] = (
    chat.register,
    cancel.register,
    models.register,
    health.register,
)
