"""argparse value types the ``afm`` subcommands of this package share."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["byte_count", "int_at_least", "int_or_auto", "port", "positive_seconds", "seconds_or_zero"]


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


def int_at_least(lo: int) -> Callable[[str], int]:
    """An integer at least ``lo``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}")
        return value

    return parse


def int_or_auto(lo: int) -> Callable[[str], int | None]:
    """An integer at least ``lo``, or ``auto`` (None: the engine decides)."""
    number = int_at_least(lo)

    def parse(text: str) -> int | None:
        if text.strip().lower() == "auto":
            return None
        try:
            int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor 'auto'") from None
        return number(text)

    return parse


def seconds_or_zero(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError("must be a number of seconds >= 0")
    return value


def port(text: str) -> int:
    """A TCP port (0: any free one)."""
    value = int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError("must be <= 65535")
    return value
