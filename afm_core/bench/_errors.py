"""The benchmark harness's exceptions (the engine's are in ``afm_core._errors``).

    Exception
    ├── HTTPClientError        a request that got no complete HTTP answer
    │   ├── ConnectError       the server did not accept the connection
    │   └── TransportError     the connection broke, or the bytes were not HTTP/1.1
    └── RuntimeError
        └── ServerStartError   a server under test exited or never became healthy

None of them reaches a served client: they end a benchmark target with a
message in its report.
"""

from __future__ import annotations

__all__ = ["ConnectError", "HTTPClientError", "ServerStartError", "TransportError"]


class HTTPClientError(Exception):
    """A request that got no complete HTTP answer."""


class ConnectError(HTTPClientError):
    """The server did not accept the connection."""


class TransportError(HTTPClientError):
    """The connection failed, or the server's bytes were not valid HTTP/1.1."""


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time."""
