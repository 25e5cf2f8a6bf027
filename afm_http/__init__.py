"""afm's OpenAI-compatible HTTP server: a quart-trio app on hypercorn.

    async with open_engine(model) as engine:
        await serve_engine(engine, host="127.0.0.1", port=9999, server=ServerConfig())

``afm serve`` is the command line for it (:mod:`afm_http._serve_cli`);
:func:`afm_http.testing.running_server` runs one on a free loopback port.
"""

from __future__ import annotations

from ._app import create_app as create_app
from ._server import hypercorn_config as hypercorn_config
from ._server import serve_engine as serve_engine
from ._state import ServerConfig as ServerConfig

__all__ = ["ServerConfig", "create_app", "hypercorn_config", "serve_engine"]
