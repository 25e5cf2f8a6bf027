"""The ``afm`` subcommands' shared argparse value types (``afm_http._argtypes``)."""

from __future__ import annotations

import argparse

import pytest

from afm_http import _argtypes as at


def test_integers_ports_and_seconds() -> None:
    assert at.int_at_least(1)("3") == 3 and at.int_at_least(0)("0") == 0
    assert at.int_or_auto(0)("auto") is None and at.int_or_auto(0)(" AUTO ") is None and at.int_or_auto(0)("0") == 0
    assert at.port("0") == 0 and at.port("65535") == 65535
    assert at.seconds_or_zero("0") == 0.0 and at.seconds_or_zero("2.5") == 2.5
    assert at.positive_seconds("0.1") == 0.1
    assert at.byte_count("8G") == 8 << 30 and at.byte_count("512") == 512


@pytest.mark.parametrize(("parse", "text", "says"), [
    (at.int_at_least(1), "0", ">= 1"),
    (at.int_at_least(1), "x", "not an integer"),
    (at.int_or_auto(0), "-1", ">= 0"),
    (at.int_or_auto(0), "sometimes", "neither an integer nor 'auto'"),
    (at.port, "65536", "<= 65535"),
    (at.port, "-1", ">= 0"),
    (at.seconds_or_zero, "-1", ">= 0"),
    (at.seconds_or_zero, "inf", ">= 0"),
    (at.seconds_or_zero, "soon", "not a number"),
    (at.positive_seconds, "0", "positive"),
    (at.byte_count, "0", "at least 1 byte"),
    (at.byte_count, "8Q", "byte count"),
])
def test_bad_values_say_why(parse: object, text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        parse(text)  # type: ignore[operator]
