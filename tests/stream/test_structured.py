"""Structured output: fence stripping under random splits, incremental release, schema validation."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afm_core._stream.events import ContentDelta
from afm_core._stream.structured import StructuredOutput, StructuredResult, make_structured_output
from afm_core._stream.structured_schema import validate
from tests.stream.helpers import feed_all, random_split

OBJ = {"type": "json_object"}
PAYLOAD = '{\n  "name": "Ada",\n  "tags": ["x", "```not a fence"],\n  "n": 3\n}'


def run(text: str | list[str], fmt: dict[str, Any] = OBJ) -> tuple[str, StructuredResult]:
    """Feed ``text`` (one piece, or a list of pieces) and flush: the output and the result."""
    s = StructuredOutput(fmt)
    events = feed_all(s, [text] if isinstance(text, str) else text)
    assert all(type(e) is ContentDelta and e.text for e in events)
    assert s.result is not None
    return "".join(e.text for e in events), s.result


@pytest.mark.parametrize(
    ("text", "fenced"),
    [
        (PAYLOAD, False),
        ("  \n" + PAYLOAD + "\n\n", False),
        ("```json\n" + PAYLOAD + "\n```", True),
        ("\n ```JSON \n" + PAYLOAD + "\n```\n", True),
        ("```\n" + PAYLOAD + "\n```", True),
        ("```json " + PAYLOAD + "\n  ```", True),
    ],
)
def test_unfenced_payload(text: str, fenced: bool) -> None:
    out, result = run(text)
    assert out == PAYLOAD
    assert result.valid and result.fenced == fenced and result.value == json.loads(PAYLOAD)
    assert not result.trailing


def test_text_after_the_closing_fence_is_dropped() -> None:
    out, result = run("```json\n[1]\n```\nHope that helps!", fmt={"type": "json_schema", "json_schema": {}})
    assert out == "[1]" and result.valid and result.trailing


def test_payload_streams_before_the_end() -> None:
    s = StructuredOutput(OBJ)
    assert s.feed(" ") == [] and s.feed("`") == [] and s.feed("``js") == []
    assert s.feed("on\n{") == [ContentDelta("{")]
    assert s.feed('"a": 1') == [ContentDelta('"a": 1')]
    assert s.feed("}\n`") == [ContentDelta("}")]  # "\n`" may be the closing fence
    assert s.feed("``") == []
    assert s.flush() == [] and s.result is not None and s.result.valid


def test_unfenced_streams_at_once_and_holds_only_trailing_whitespace() -> None:
    s = StructuredOutput(OBJ)
    assert s.feed("{") == [ContentDelta("{")]
    assert s.feed('"a": \n  ') == [ContentDelta('"a":')]
    assert s.feed("1}") == [ContentDelta(" \n  1}")]
    assert s.flush() == []


def test_invalid_results_are_reported_not_raised() -> None:
    out, result = run("Sure! {'a': 1}")
    assert out == "Sure! {'a': 1}" and not result.valid and "not valid JSON" in result.errors[0]
    assert run("[1, 2]")[1].errors == ("expected a JSON object",)
    assert not run("```json\n{\"a\": ")[1].valid  # unterminated
    assert run("")[1].valid is False
    assert run("``")[0] == "``"


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_validation() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    assert run('```json\n{"name": "Ada", "age": 36}\n```', fmt=fmt)[1].valid
    result = run('{"name": "", "age": -1, "x": 1}', fmt=fmt)[1]
    assert not result.valid
    assert set(result.errors) == {
        "$: property 'x' is not allowed",
        "$.name: expected at least 1 characters, got 0",
        "$.age: -1 is less than the minimum 0",
    }


def test_factory() -> None:
    assert make_structured_output(None) is None
    assert make_structured_output({"type": "text"}) is None
    assert isinstance(make_structured_output(OBJ), StructuredOutput)


TEXTS = [
    "```json\n" + PAYLOAD + "\n```",
    "  " + PAYLOAD + " \n",
    "\n```\n[1, 2]\n```\ntrailing words",
    "`x`",
    '```py\nprint("```")\n```',
    "```json",
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.data())
def test_random_splits_match_one_shot(text: str, data: st.DataObject) -> None:
    assert run(random_split(data, text, 30)) == run(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=" \n`{}[]\"a1:,json", max_size=40), st.data())
def test_fuzz_split_independent(text: str, data: st.DataObject) -> None:
    out, result = run(random_split(data, text, 10))
    assert (out, result) == run(text)
    assert out == out.strip()  # never leading/trailing whitespace
    if not text.lstrip().startswith("`"):
        assert out == text.strip()  # an unfenced payload passes through


# -- the validator -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        ({"type": "integer"}, [1, 2.0, -3], [1.5, True, "1", None]),
        ({"type": "number"}, [1, 1.5], [True, "x"]),
        ({"type": ["string", "null"]}, ["a", None], [1, []]),
        ({"enum": [1, "a", None]}, [1, 1.0, "a", None], [True, "b"]),
        ({"const": False}, [False], [0, None]),
        ({"type": "string", "maxLength": 2, "pattern": "^a"}, ["a", "ab"], ["abc", "b"]),
        ({"type": "number", "exclusiveMinimum": 0, "maximum": 10, "multipleOf": 0.5},
         [0.5, 10], [0, 10.5, 1.25]),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2, "uniqueItems": True},
         [[1], [1, 2]], [[], [1, 2, 3], [1, 1], ["a"]]),
        ({"prefixItems": [{"type": "string"}], "items": {"type": "integer"}}, [["a", 1], []], [[1], ["a", "b"]]),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, ["a", 1], [1.5, None]),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, [1.5], [1, "a"]),
        ({"allOf": [{"minimum": 1}, {"maximum": 2}]}, [1, 2], [0, 3]),
        ({"not": {"type": "null"}}, [1], [None]),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"},
          "minProperties": 1}, [{"a": 1}, {"b": "x"}], [{}, {"b": 1}, {"a": "x"}, []]),
        ({"patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
         [{"x1": 1}], [{"x1": "a"}, {"y": 1}]),
        (True, [1, None], []),
        (False, [], [1]),
    ],
)
def test_validator_keywords(schema: Any, good: list[Any], bad: list[Any]) -> None:
    for value in good:
        assert validate(value, schema) == [], value
    for value in bad:
        assert validate(value, schema), value


def test_validator_refs_and_paths() -> None:
    schema = {
        "$defs": {"node": {"type": "object", "properties": {
            "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["v"]}},
        "$ref": "#/$defs/node",
    }
    assert validate({"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}, schema) == []
    assert validate({"v": 1, "kids": [{"v": 2, "kids": [{}]}]}, schema) == [
        "$.kids[0].kids[0]: missing required property 'v'"
    ]
    assert validate(1, {"$ref": "#/definitions/missing"}) == ["$: unresolvable $ref '#/definitions/missing'"]
    assert validate(1, {"$ref": "#"}) == ["$: schema nesting too deep (recursive $ref?)"]
    assert validate({"a b": "x"}, {"properties": {"a b": {"type": "integer"}}}) == [
        "$['a b']: expected integer, got string"
    ]
