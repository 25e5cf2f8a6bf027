"""Types of the Cython build ``sse_c`` (from ``ext/stream/sse_c.pyx``); twin of ``sse_py``.

``DONE``, ``dumps`` and ``frame`` are the pure twin's own objects, re-exported.
"""

from collections.abc import Iterable
from typing import Any

from .events import Event
from .sse_py import DONE as DONE
from .sse_py import dumps as dumps
from .sse_py import frame as frame

__all__ = ["DONE", "SSEEncoder", "dumps", "escape_json_string", "frame"]

def escape_json_string(text: str) -> bytes: ...

class SSEEncoder:
    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        *,
        system_fingerprint: str | None = None,
        index: int = 0,
    ) -> None: ...
    @property
    def id(self) -> str: ...
    @property
    def created(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def system_fingerprint(self) -> str | None: ...
    @property
    def index(self) -> int: ...
    def chunk(self, event: Event) -> dict[str, Any]: ...
    def chunks(self, events: Iterable[Event]) -> list[dict[str, Any]]: ...
    def encode(self, event: Event) -> bytes: ...
    def encode_many(self, events: Iterable[Event]) -> bytes: ...
    def done(self) -> bytes: ...
