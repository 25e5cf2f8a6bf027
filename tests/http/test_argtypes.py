"""The ``afm`` subcommands' shared argparse value types (``afm_http._argtypes``)."""

from __future__ import annotations

import argparse

import pytest

from afm_http._argtypes import (
    byte_count,
    int_at_least,
    int_or_auto,
    port,
    positive_seconds,
    seconds_or_zero,
)


def test_integers_ports_and_seconds() -> None:
    assert int_at_least(1)("3") == 3 and int_at_least(0)("0") == 0
    assert int_or_auto(0)("auto") is None and int_or_auto(0)(" AUTO ") is None and int_or_auto(0)("0") == 0
    assert port("0") == 0 and port("65535") == 65535
    assert seconds_or_zero("0") == 0.0 and seconds_or_zero("2.5") == 2.5
    assert positive_seconds("0.1") == 0.1
    assert byte_count("8G") == 8 << 30 and byte_count("512") == 512


@pytest.mark.parametrize(("parse", "text", "says"), [
    (int_at_least(1), "0", ">= 1"),
    (int_at_least(1), "x", "not an integer"),
    (int_or_auto(0), "-1", ">= 0"),
    (int_or_auto(0), "sometimes", "neither an integer nor 'auto'"),
    (port, "65536", "<= 65535"),
    (port, "-1", ">= 0"),
    (seconds_or_zero, "-1", ">= 0"),
    (seconds_or_zero, "inf", ">= 0"),
    (seconds_or_zero, "soon", "not a number"),
    (positive_seconds, "0", "positive"),
    (byte_count, "0", "at least 1 byte"),
    (byte_count, "8Q", "byte count"),
])
def test_bad_values_say_why(parse: object, text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        parse(text)  # type: ignore[operator]
