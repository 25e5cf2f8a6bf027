"""The bounded in-memory store behind ``store: true`` Responses (sans-IO).

OpenAI keeps every response created with ``store: true`` (the default) so that
``GET /v1/responses/{id}`` returns it and ``previous_response_id`` continues
from it.  afm keeps finished responses in memory, bounded three ways:

* ``max_responses`` (default 1000): past it, the oldest response is evicted
  (0 keeps nothing);
* ``max_bytes`` (default 128 MiB): the responses' sizes together (each
  counted as the UTF-8 bytes of its JSON: the Response object, which echoes
  the request's instructions, tools and schema, and its input items); past
  it, the oldest are evicted, and a response larger than the whole budget
  is not kept at all (``GET`` then finds nothing, as after an eviction);
* ``max_age`` seconds (default 3600, one hour): an older response is gone,
  as if deleted.

Age counts from when the response was stored (when it finished), on the
store's clock (``time.monotonic`` unless a test injects another).  A stored
response holds its final Response object and the conversation items it was
generated from, which is what a continuation replays (one with several choices,
``n`` > 1, holds them all, and is not continued: see :attr:`StoredResponse.choices`)::

    store = ResponseStore(max_responses=1000, max_age=3600.0, max_bytes=128 << 20)
    store.put(StoredResponse(response=writer.response, input_items=call.conversation))
    store.get("resp_...")          # None once evicted, expired or deleted

The store is a plain object: no locks (one Trio thread owns it) and no I/O.

May import: the standard library (see :mod:`afm_core.api`).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_MAX_AGE", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_RESPONSES", "ResponseStore",
           "StoredResponse", "stored_size"]

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_AGE = 3600.0
DEFAULT_MAX_BYTES = 128 << 20
"""128 MiB of stored responses (their JSON) at most."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response and the items it was generated from."""

    response: dict[str, Any]
    """The final Response object (``GET /v1/responses/{id}`` returns it)."""
    input_items: tuple[dict[str, Any], ...]
    """The conversation before its output: the earlier responses' items
    (through ``previous_response_id``) and its own input, normalized."""

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def choices(self) -> int:
        """How many choices it holds (the ``n`` its Response object echoes; 1 without)."""
        n = self.response.get("n")
        return n if isinstance(n, int) and n > 1 else 1

    @property
    def conversation(self) -> tuple[dict[str, Any], ...]:
        """What a continuation starts from: the input items, then the output items."""
        return self.input_items + tuple(self.response.get("output") or ())


def stored_size(stored: StoredResponse) -> int:
    """What ``stored`` counts against ``max_bytes``: the UTF-8 bytes of its JSON."""
    text = json.dumps([stored.response, stored.input_items], ensure_ascii=False,
                      separators=(",", ":"), default=str)
    return len(text.encode("utf-8", "surrogatepass"))


class ResponseStore:
    """Finished responses by id, at most ``max_responses`` of them and
    ``max_bytes`` together, none older than ``max_age`` seconds; the oldest
    is evicted first."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_age: float = DEFAULT_MAX_AGE,
                 *, max_bytes: int = DEFAULT_MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_responses < 0:
            raise ValueError("max_responses must be >= 0")
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        if not max_age > 0:
            raise ValueError("max_age must be > 0 seconds")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.max_age = max_age
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, StoredResponse, int]] = OrderedDict()
        self._bytes = 0

    @property
    def bytes(self) -> int:
        """The stored responses' sizes together (see :func:`stored_size`)."""
        return self._bytes

    def put(self, stored: StoredResponse) -> bool:
        """Keep ``stored`` (replacing one with the same id), evicting what is
        expired, then the oldest beyond ``max_responses`` or ``max_bytes``;
        False when it was not kept (no room at all, or larger than ``max_bytes``)."""
        self._pop(stored.id)
        if self.max_responses == 0:
            return False
        size = stored_size(stored)
        if size > self.max_bytes:
            return False
        now = self._clock()
        self._items[stored.id] = (now, stored, size)
        self._bytes += size
        self._expire(now)
        while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
            self._pop(next(iter(self._items)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, evicted, expired or deleted)."""
        self._expire(self._clock())
        entry = self._items.get(response_id)
        return entry[1] if entry is not None else None

    def delete(self, response_id: str) -> bool:
        """Forget a response; False if it was not stored (or had expired)."""
        self._expire(self._clock())
        return self._pop(response_id)

    def _pop(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry[2]
        return True

    def purge(self) -> int:
        """Drop every expired response now; how many were dropped."""
        before = len(self._items)
        self._expire(self._clock())
        return before - len(self._items)

    def _expire(self, now: float) -> None:
        # insertion order is storing order, so the expired ones are at the front
        items = self._items
        while items:
            oldest, (at, _, _) = next(iter(items.items()))
            if now - at < self.max_age:
                break
            self._pop(oldest)

    def __contains__(self, response_id: object) -> bool:
        return isinstance(response_id, str) and self.get(response_id) is not None

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._items)
