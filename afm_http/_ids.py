"""Request correlation ids: validated when the client sends one, minted otherwise.

A client id is echoed in response headers, used as the cancel path and
written to log lines, so only a short, safe alphabet is accepted: it starts
with a letter or digit and continues with letters, digits and ``. _ : -``
(no CR/LF, spaces, quotes, slashes or non-ASCII), at most 128 characters.
The engine keeps the in-flight registry (duplicates raise
:class:`~afm_core._errors.DuplicateRequestError`, HTTP 409).
"""

from __future__ import annotations

import re
import secrets

__all__ = ["MAX_ID_LENGTH", "ID_RULE", "client_request_id", "mint_request_id", "valid_request_id"]

MAX_ID_LENGTH = 128
ID_RULE = f"1-{MAX_ID_LENGTH} characters of [A-Za-z0-9._:-], starting with a letter or digit"
_VALID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,%d}" % (MAX_ID_LENGTH - 1))


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
