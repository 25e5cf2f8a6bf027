"""Chunk accumulator: contract cases, encoder round trips, twin equivalence."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afm_core._errors import StreamErrorChunk, StreamProtocolError
from afm_core._stream.events import (
    ContentDelta,
    Finish,
    LogprobsDelta,
    Profile,
    ReasoningDelta,
    StreamFailure,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from afm_core._stream.sse_py import SSEEncoder
from tests.stream.helpers import PY, TWINSETS, C, TwinSet, random_split


def sse(*objs: Any) -> bytes:
    return b"".join(
        b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs
    )


def choice(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }


SPEC_STREAM = sse(
    choice({"role": "assistant", "content": "First"}),
    choice({"content": " line"}),
    choice({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "read_file", "arguments": '{"pa'}}]}),
    choice({"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "ls", "arguments": ""}}]}),
    choice({"tool_calls": [{"index": 0, "function": {"arguments": 'th":"README.md"}'}}]}),
    choice({"tool_calls": [{"index": 1, "id": None, "function": {"name": None, "arguments": "{}"}}]}),
    choice({"reasoning_content": "hm"}),
    choice({}, "tool_calls"),
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 18, "completion_tokens": 9, "total_tokens": 27}},
    {"afm_profile": {"chip": "M4"}},
    b"[DONE]",
)

SPEC_RESULT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 5,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "First line",
                "reasoning_content": "hm",
                "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"README.md"}'}},
                    {"id": "call_b", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 18, "completion_tokens": 9, "total_tokens": 27},
    "afm_profile": {"chip": "M4"},
}


def test_spec_stream(twin: TwinSet) -> None:
    acc = twin.accumulate.ChunkAccumulator()
    acc.feed_bytes(SPEC_STREAM)
    acc.close()
    assert acc.result() == SPEC_RESULT
    assert acc.parse_tool_arguments() == [{"path": "README.md"}, {}]


def test_crlf_comments_and_multiline_data(twin: TwinSet) -> None:
    body = (
        b": keep-alive\r\n\r\nevent: message\r\nid: 1\r\ndata: {\"choices\":[{\"index\":0,\r\n"
        b"data: \"delta\":{\"content\":\"x\"}}]}\r\n\r\ndata:[DONE]\r\n\r\n"
    )
    for step in (1, 2, 3, len(body)):
        acc = twin.accumulate.ChunkAccumulator()
        for i in range(0, len(body), step):
            acc.feed(body[i : i + step])
        acc.close()
        assert acc.result()["choices"][0]["message"]["content"] == "x"


def test_lone_cr_line_endings(twin: TwinSet) -> None:
    acc = twin.accumulate.ChunkAccumulator()
    for piece in (b'data: {"choices":[{"delta":{"content":"y"}}]}\r', b"\r", b"data: [DONE]\r", b"\n", b"\r"):
        acc.feed_bytes(piece)
    acc.close()
    assert acc.result()["choices"][0]["message"]["content"] == "y"


def test_data_after_done_is_a_protocol_error(twin: TwinSet) -> None:
    acc = twin.accumulate.ChunkAccumulator()
    acc.feed_bytes(sse(choice({"content": "a"}), b"[DONE]") + b": comment\n\n")
    with pytest.raises(StreamProtocolError, match="after"):
        acc.feed_bytes(sse(choice({"content": "b"})))
    acc = twin.accumulate.ChunkAccumulator()
    acc.feed_done()
    with pytest.raises(StreamProtocolError):
        acc.feed_done()


def test_missing_done_and_early_result(twin: TwinSet) -> None:
    acc = twin.accumulate.ChunkAccumulator()
    acc.feed_bytes(sse(choice({"content": "a"})))
    with pytest.raises(StreamProtocolError, match="DONE"):
        acc.result()
    with pytest.raises(StreamProtocolError):
        acc.parse_tool_arguments()
    with pytest.raises(StreamProtocolError, match="before"):
        acc.close()


def test_error_chunk_raises(twin: TwinSet) -> None:
    acc = twin.accumulate.ChunkAccumulator()
    acc.feed_bytes(sse(choice({"content": "a"})))
    err = {"message": "boom", "type": "server_error", "param": None, "code": "generation_failed"}
    with pytest.raises(StreamErrorChunk) as info:
        acc.feed_bytes(sse({"id": "x", "choices": [], "error": err}))
    assert info.value.error == err and info.value.code == "generation_failed"
    assert str(info.value) == "boom"
    with pytest.raises(StreamErrorChunk, match="plain"):
        twin.accumulate.ChunkAccumulator().feed_chunk({"error": "plain"})


@pytest.mark.parametrize(
    "bad",
    [
        b"data: {not json\n\n",
        b"data: [1,2]\n\n",
        b'data: {"id":"x"}\n\n',
        b'data: {"choices":{}}\n\n',
        b'data: {"choices":[{"delta":{"content":5}}]}\n\n',
        b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"x"}}]}}]}\n\n',
        b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":1}}]}}]}\n\n',
        b'data: {"choices":[{"index":"0","delta":{}}]}\n\n',
        b'data: {"choices":[],"usage":3}\n\n',
        b"data: \xff\n\n",
    ],
)
def test_malformed_chunks(twin: TwinSet, bad: bytes) -> None:
    with pytest.raises(StreamProtocolError):
        twin.accumulate.ChunkAccumulator().feed_bytes(bad)


def test_invalid_tool_arguments_fail_validation_only(twin: TwinSet) -> None:
    acc = twin.accumulate.ChunkAccumulator()
    acc.feed_chunk(choice({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":'}}]}))
    acc.feed_done()
    assert acc.result()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"a":'
    with pytest.raises(StreamProtocolError, match="tool call 0"):
        acc.parse_tool_arguments()


def test_accumulate_helper(twin: TwinSet) -> None:
    assert twin.accumulate.accumulate([SPEC_STREAM[:50], SPEC_STREAM[50:]]) == SPEC_RESULT
    out = twin.accumulate.accumulate([choice({"content": "a"}), choice({}, "stop")])
    assert out["choices"][0]["message"]["content"] == "a"
    assert out["choices"][0]["message"]["reasoning_content"] is None
    with pytest.raises(StreamProtocolError):
        twin.accumulate.accumulate([SPEC_STREAM[:-14]])


def test_multiple_choices(twin: TwinSet) -> None:
    out = twin.accumulate.accumulate([choice({"content": "b"}, index=1), choice({"content": "a"}), choice({}, "stop", 1)])
    assert [c["message"]["content"] for c in out["choices"]] == ["a", "b"]
    assert [c["finish_reason"] for c in out["choices"]] == [None, "stop"]


# -- round trips through the encoder --------------------------------------------

EVENTS = [
    ReasoningDelta("Let me think."),
    ContentDelta("Hello, "),
    LogprobsDelta((TokenLogprob("Hello", -0.25, (72,)),)),
    ContentDelta("世界 😀 \"quoted\"\n"),
    ToolCallDelta(0, '{"path": "RE', id="call_1", name="read_file"),
    ToolCallDelta(1, "", id="call_2", name="ls"),
    ToolCallDelta(0, 'ADME.md"}'),
    ToolCallDelta(1, "{}"),
    Finish("tool_calls"),
    Usage(10, 20, cached_tokens=3),
    Profile({"decode_tps": 42.5}, extended=True),
]


def expected_result() -> dict[str, Any]:
    return {
        "id": "chatcmpl-rt",
        "object": "chat.completion",
        "created": 7,
        "model": "afm/m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": 'Hello, 世界 😀 "quoted"\n',
                    "reasoning_content": "Let me think.",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "README.md"}'}},
                        {"id": "call_2", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
                    ],
                },
                "logprobs": {"content": [{"token": "Hello", "logprob": -0.25, "bytes": [72], "top_logprobs": []}]},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": Usage(10, 20, cached_tokens=3).to_dict(),
        "afm_profile_extended": {"decode_tps": 42.5},
    }


@pytest.mark.parametrize("encoder", TWINSETS, ids=repr)
def test_round_trip_bytes_and_dicts(twin: TwinSet, encoder: TwinSet) -> None:
    enc = encoder.sse.SSEEncoder("chatcmpl-rt", 7, "afm/m")
    body = enc.encode_many(EVENTS) + enc.done()
    assert twin.accumulate.accumulate([body]) == expected_result()
    # The non-streaming path: chunk dicts, no bytes.
    enc = encoder.sse.SSEEncoder("chatcmpl-rt", 7, "afm/m")
    acc = twin.accumulate.ChunkAccumulator()
    for chunk in enc.chunks(EVENTS):
        acc.feed_chunk(chunk)
    acc.feed_done()
    assert acc.result() == expected_result()
    assert acc.parse_tool_arguments() == [{"path": "README.md"}, {}]


def test_round_trip_error_event(twin: TwinSet) -> None:
    enc = SSEEncoder("chatcmpl-e", 1, "m")
    body = enc.encode_many([ContentDelta("x"), StreamFailure("oom", code="generation_failed")]) + enc.done()
    with pytest.raises(StreamErrorChunk, match="oom"):
        twin.accumulate.accumulate([body])


# -- Hypothesis: random byte boundaries, both twins ------------------------------

piece = st.text(max_size=6)
event = st.one_of(
    st.builds(ContentDelta, piece),
    st.builds(ReasoningDelta, piece),
    st.builds(ToolCallDelta, st.integers(0, 2), piece),
    st.builds(ToolCallDelta, st.integers(0, 2), piece, id=st.just("call_z"), name=st.just("f")),
)


def outcome(twin: TwinSet, parts: list[bytes]) -> Any:
    acc = twin.accumulate.ChunkAccumulator()
    try:
        for part in parts:
            acc.feed_bytes(part)
        acc.close()
        return acc.result()
    except StreamProtocolError as exc:
        return (type(exc).__name__, str(exc))


@settings(max_examples=200, deadline=None)
@given(events=st.lists(event, max_size=12), data=st.data(), junk=st.booleans())
def test_twins_agree_on_random_boundaries(events: list[Any], data: st.DataObject, junk: bool) -> None:
    enc = SSEEncoder("chatcmpl-h", 1, "m")
    body = enc.encode_many([*events, Finish("stop")]) + enc.done()
    if junk:
        body += b'data: {"late": true}\n\n'
    parts = random_split(data, body, 10)
    c, py = outcome(C, parts), outcome(PY, parts)
    assert c == py
    if junk:
        assert c[0] == "StreamProtocolError"
        return
    message = c["choices"][0]["message"]
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert message["content"] == (content if any(isinstance(e, ContentDelta) for e in events) else None)
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            args[e.index] = args.get(e.index, "") + e.arguments
    assert [t["function"]["arguments"] for t in message.get("tool_calls", [])] == [args[k] for k in sorted(args)]
