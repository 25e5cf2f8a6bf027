"""The Embeddings API translation: body -> inputs, vectors -> the response object."""

from __future__ import annotations

import base64
import math
import struct

import pytest

from afm_core import RequestError
from afm_core.api import embeddings as api


@pytest.mark.parametrize(("value", "inputs"), [
    ("hello", ("hello",)),
    (["a", "b c"], ("a", "b c")),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
    (["text", [4, 5]], ("text", (4, 5))),
])
def test_input_forms(value: object, inputs: tuple) -> None:
    call = api.parse({"input": value, "model": "m", "user": "someone"})
    assert call.inputs == inputs
    assert call.encoding_format == "float" and call.dimensions is None and call.model == "m"


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": [[1], []]}, "input[1]"),
    ({"input": [1, -2]}, "input"),
    ({"input": [1, True]}, "input[0]"),
    ({"input": [[1, 2.5]]}, "input[0]"),
    ({"input": 3}, "input"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": [None]}, "input[0]"),
    ({"input": "\ud800"}, "input"),
    ({"input": ["x"] * (api.MAX_INPUTS + 1)}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "encoding_format": 1}, "encoding_format"),
    ({"input": "x", "encoding_format": ""}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": "x", "model": 5}, "model"),
    ({"input": "x", "user": 5}, "user"),
])
def test_bad_bodies(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as info:
        api.parse(body)
    assert info.value.status == 400 and info.value.param == param


def test_body_must_be_an_object() -> None:
    with pytest.raises(RequestError):
        api.parse(["input"])


def test_response_float_and_usage() -> None:
    call = api.parse({"input": ["a", "b"]})
    obj = api.response(call, [[0.6, 0.8], [1.0, 0.0]], model="m", prompt_tokens=5)
    assert obj == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]},
                 {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]}],
        "model": "m",
        "usage": {"prompt_tokens": 5, "total_tokens": 5},
    }


def test_response_base64_is_little_endian_float32() -> None:
    call = api.parse({"input": "a", "encoding_format": "base64"})
    vec = [0.25, -0.5, 0.1]
    obj = api.response(call, [vec], model="m", prompt_tokens=1)
    raw = base64.b64decode(obj["data"][0]["embedding"])
    assert raw == struct.pack("<3f", *vec)
    assert struct.unpack("<3f", raw) == pytest.approx(vec)


def test_dimensions_truncate_and_renormalize() -> None:
    vec = [0.5, 0.5, 0.5, 0.5]
    call = api.parse({"input": "a", "dimensions": 2})
    out = api.response(call, [vec], model="m", prompt_tokens=1)["data"][0]["embedding"]
    assert out == pytest.approx([1 / math.sqrt(2)] * 2)
    assert api.resize(vec, 4) == vec and api.resize(vec, None) == vec


def test_dimensions_beyond_the_hidden_size() -> None:
    call = api.parse({"input": "a", "dimensions": 5})
    with pytest.raises(RequestError, match=r"hidden size \(4\)") as info:
        api.response(call, [[0.5] * 4], model="m", prompt_tokens=1)
    assert info.value.param == "dimensions" and info.value.status == 400
