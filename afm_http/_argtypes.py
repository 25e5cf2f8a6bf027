"""argparse value types the ``afm`` subcommands of this package share."""

from __future__ import annotations

import argparse

__all__ = ["byte_count", "positive_seconds"]


def positive_seconds(text: str) -> float:
    """A finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


_BYTE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
               "tib": 1 << 40}


def byte_count(text: str) -> int:
    """A number of bytes above 0, with an optional binary unit (``512M``, ``8G``, ``1.5GiB``)."""
    body = text.strip().lower()
    number = body.rstrip("kmgtib")
    unit = body[len(number):]
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count such as 4096, 512M or 8G") from None
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError("must be at least 1 byte")
    return int(value)
