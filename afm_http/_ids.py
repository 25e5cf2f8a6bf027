"""Request correlation ids: validated when the client sends one, minted otherwise.

A client id is echoed in response headers, used as the cancel path and
written to log lines, so only a short, safe alphabet is accepted: it starts
with a letter or digit and continues with letters, digits and ``. _ : -``
(no CR/LF, spaces, quotes, slashes or non-ASCII), at most 128 characters.
The engine keeps the authoritative in-flight registry (duplicates raise
:class:`~afm_core.DuplicateRequestError`, HTTP 409); :class:`InFlight`
only remembers which ids this app opened, to cancel them at shutdown.
"""

from __future__ import annotations

import re
import secrets
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["ID_RULE", "MAX_ID_LENGTH", "InFlight", "client_request_id", "mint_request_id", "valid_request_id"]

MAX_ID_LENGTH = 128
ID_RULE = f"1-{MAX_ID_LENGTH} characters of [A-Za-z0-9._:-], starting with a letter or digit"
_VALID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:\-]{{0,{MAX_ID_LENGTH - 1}}}")


def valid_request_id(value: str) -> bool:
    """True if ``value`` is safe to echo, log and route on."""
    return _VALID.fullmatch(value) is not None


def mint_request_id() -> str:
    """A fresh id (``req_`` and 24 hex digits)."""
    return f"req_{secrets.token_hex(12)}"


def client_request_id(header: str | None) -> tuple[str, bool]:
    """``(id, valid)`` for an ``X-Request-ID`` header value.

    A missing or blank header gets a minted id; an invalid one also gets a
    minted id (to label the 400 response) with ``valid`` False.
    """
    if header is None or not header.strip():
        return mint_request_id(), True
    if valid_request_id(header):
        return header, True
    return mint_request_id(), False


class InFlight:
    """Request ids this app has open with the engine, so shutdown can cancel them
    and a drain can wait for them (:meth:`wait_empty`).

    An id is held from before ``engine.stream(...)`` is entered until after
    it is left (a duplicate id briefly holds twice, hence the counts).
    """

    def __init__(self) -> None:
        self._held: Counter[str] = Counter()
        self._emptied = trio.lowlevel.ParkingLot()

    @contextmanager
    def hold(self, request_id: str) -> Iterator[None]:
        self._held[request_id] += 1
        try:
            yield
        finally:
            self._held[request_id] -= 1
            if self._held[request_id] <= 0:
                del self._held[request_id]
                if not self._held:
                    self._emptied.unpark_all()

    async def wait_empty(self) -> None:
        """Return once no request id is held (at once if none is)."""
        while self._held:
            await self._emptied.park()

    def ids(self) -> list[str]:
        return list(self._held)

    def __len__(self) -> int:
        return len(self._held)
