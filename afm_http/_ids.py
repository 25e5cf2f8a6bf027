"""Request correlation ids: validated when the client sends one, minted otherwise.

A client id ends up in response headers and log lines, so only a safe,
bounded alphabet is accepted (no CR/LF, no spaces, no quotes).
"""

from __future__ import annotations

import re
import secrets

MAX_ID_LENGTH = 128
_VALID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,%d}$" % (MAX_ID_LENGTH - 1))


def valid_request_id(value: str) -> bool:
    return bool(_VALID.fullmatch(value))


def mint_request_id() -> str:
    return f"req_{secrets.token_hex(12)}"
