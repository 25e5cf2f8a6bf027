"""The HTTP routes, one module per API surface.

Each module here has module-level handlers (they find the engine and options
through :func:`afm_http._state.current_state`) and a ``register(app)`` that
adds its URL rules.  :func:`route_modules` finds every such module, so a new
API is a new module in this folder and nothing else: the middleware (ids,
auth, CORS, error envelope) applies to it unchanged.  Handler names become
Quart endpoint names and must be unique across modules (or pass
``endpoint=``).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType

from .._asgi import AFMQuart

__all__ = ["ROUTES", "route_modules"]


def route_modules() -> list[ModuleType]:
    """Every module of this package that has a ``register(app)``, by name."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if callable(getattr(module, "register", None)):
            found.append(module)
    return found


ROUTES: tuple[Callable[[AFMQuart], None], ...] = tuple(m.register for m in route_modules())
