"""SSE encoder: exact JSON, chunk shapes, twin equivalence, the openai SDK as a client."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afm_core._stream.events import (
    ContentDelta,
    Finish,
    LogprobsDelta,
    Profile,
    ReasoningDelta,
    StreamFailure,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from tests.stream.helpers import PY, C, TwinSet


def encoder(twin: TwinSet, **kw: Any) -> Any:
    return twin.sse.SSEEncoder("chatcmpl-abc", 1700000000, "afm/test", **kw)


def frames(data: bytes) -> list[Any]:
    assert not data or data.endswith(b"\n\n")
    out = []
    for block in data.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: ")
        payload = block[6:].decode("utf-8")
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


TRICKY = ['a"b\\c', "\n\r\t\b\f\x00\x1f\x7f", "中文 😀 é", "\u2028\u2029", "</script>", ""]


@pytest.mark.parametrize("text", TRICKY)
def test_content_frame_is_exactly_json_dumps(twin: TwinSet, text: str) -> None:
    enc, ref = encoder(twin), encoder(twin)
    for event in (ContentDelta(text), ReasoningDelta(text), ContentDelta(text)):
        data = enc.encode(event)
        assert data == b"data: " + dumps(ref.chunk(event)) + b"\n\n"


def _reference(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "afm.json_surrogates")


_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**40), max_value=10**40)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text() | st.sampled_from([*TRICKY, "\ud800"]))
_values = st.recursive(
    _scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.lists(inner, max_size=3).map(tuple)
                   | st.dictionaries(st.text(max_size=8), inner, max_size=4)
                   | st.dictionaries(st.integers() | st.booleans() | st.none() | st.floats(), inner,
                                     max_size=2)),
    max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(_values)
def test_dumps_is_exactly_json_dumps(obj: Any) -> None:
    """Both twins' ``dumps`` (what the Anthropic, Responses and Completions
    frames are written with) give ``json.dumps``'s bytes, lone surrogates
    escaped, for any nesting of JSON's types, tuples and non-string keys."""
    try:
        ref = _reference(obj)
    except (ValueError, TypeError) as exc:  # e.g. keys json rejects
        for twin in (C, PY):
            with pytest.raises(type(exc)):
                twin.sse.dumps(obj)
        return
    assert C.sse.dumps(obj) == ref
    assert PY.sse.dumps(obj) == ref
    assert C.sse.frame(obj) == PY.sse.frame(obj) == b"data: " + ref + b"\n\n"


def test_dumps_hands_the_unusual_to_json(twin: TwinSet) -> None:
    """Subclasses, deep nesting and cycles come out (or fail) as json's do."""
    import enum

    class Kind(enum.IntEnum):
        A = 3

    class Name(str):
        pass

    deep: Any = "x"
    for _ in range(200):
        deep = [deep, {"k": deep}] if len(str(deep)) < 50 else [deep]
    for obj in ({"kind": Kind.A, "name": Name("n"), Name("key"): 1.0}, deep, {"d": {2: [True]}},
                {"n": float("nan"), "i": -float("inf"), "z": -0.0, "big": 10**30}):
        assert twin.sse.dumps(obj) == _reference(obj)
    cycle: list[Any] = []
    cycle.append({"c": cycle})
    with pytest.raises(ValueError, match="Circular reference"):
        twin.sse.dumps(cycle)
    with pytest.raises(TypeError):
        twin.sse.dumps({"x": object()})


def test_lone_surrogates_do_not_crash(twin: TwinSet) -> None:
    enc = encoder(twin)
    for text in ("\ud800", "a\udfffb", "\udc00\ud800"):
        (chunk,) = frames(enc.encode(ContentDelta(text)))
        assert chunk["choices"][0]["delta"]["content"] == text
    (chunk,) = frames(enc.encode(Profile({"k": "\ud800"})))
    assert chunk == {"afm_profile": {"k": "\ud800"}}
    assert twin.sse.escape_json_string("\ud800x") == b'"\\ud800x"'


def test_chunk_shapes(twin: TwinSet) -> None:
    enc = encoder(twin, system_fingerprint="fp_1")
    head = {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "afm/test",
        "system_fingerprint": "fp_1",
    }

    def choice(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> Any:
        return {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }

    events = [
        ContentDelta("Hi"),
        ReasoningDelta("hmm"),
        ToolCallDelta(0, '{"pa', id="call_1", name="read_file"),
        ToolCallDelta(0, 'th":1}'),
        ToolCallDelta(1, "{}", id="call_2", name="g"),
        Finish("tool_calls"),
        Usage(18, 9, cached_tokens=4),
        Profile({"decode_tps": 50.0}),
        Profile({"summary": {}, "samples": []}, extended=True),
    ]
    got = [frames(enc.encode(e))[0] for e in events]
    assert got == [
        choice({"role": "assistant", "content": "Hi"}),
        choice({"reasoning_content": "hmm"}),
        choice(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"pa'},
                    }
                ]
            }
        ),
        choice({"tool_calls": [{"index": 0, "function": {"arguments": 'th":1}'}}]}),
        choice(
            {
                "tool_calls": [
                    {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}
                ]
            }
        ),
        choice({}, "tool_calls"),
        {
            **head,
            "choices": [],
            "usage": {
                "prompt_tokens": 18,
                "completion_tokens": 9,
                "total_tokens": 27,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        },
        {"afm_profile": {"decode_tps": 50.0}},
        {"afm_profile_extended": {"summary": {}, "samples": []}},
    ]
    assert enc.done() == twin.sse.DONE == b"data: [DONE]\n\n"


def test_role_rides_on_the_first_choice_chunk(twin: TwinSet) -> None:
    enc = encoder(twin)
    (chunk,) = frames(enc.encode(Finish("stop")))
    assert chunk["choices"][0]["delta"] == {"role": "assistant"}
    enc = encoder(twin)
    (chunk,) = frames(enc.encode(ToolCallDelta(3, "x")))
    assert chunk["choices"][0]["delta"]["role"] == "assistant"
    (chunk,) = frames(enc.encode(ToolCallDelta(3, "y")))
    assert chunk["choices"][0]["delta"] == {"tool_calls": [{"index": 3, "function": {"arguments": "y"}}]}


def test_error_chunk(twin: TwinSet) -> None:
    (chunk,) = frames(encoder(twin).encode(StreamFailure("boom", code="generation_failed")))
    assert chunk["choices"] == []
    assert chunk["error"] == {
        "message": "boom",
        "type": "server_error",
        "param": None,
        "code": "generation_failed",
    }


def test_logprobs_merge_and_clamp(twin: TwinSet) -> None:
    lp = LogprobsDelta((TokenLogprob("Hi", float("-inf"), (72, 105), (TopLogprob("Hi", -0.1, None),)),))
    enc = encoder(twin)
    merged = frames(enc.encode_many([ContentDelta("Hi"), lp, ContentDelta("!")]))
    assert len(merged) == 2
    first = merged[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": "Hi"}
    assert first["logprobs"] == {
        "content": [
            {
                "token": "Hi",
                "logprob": -9999.0,
                "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": None}],
            }
        ]
    }
    (alone,) = frames(enc.encode(lp))
    assert alone["choices"][0]["delta"] == {} and alone["choices"][0]["logprobs"]["content"]


def test_encode_many_equals_concatenated_encode(twin: TwinSet) -> None:
    events = [ContentDelta("a"), ReasoningDelta("b"), ToolCallDelta(0, "c", id="call_x", name="n"), Finish("stop")]
    a, b = encoder(twin), encoder(twin)
    assert a.encode_many(events) == b"".join(b.encode(e) for e in events)
    assert encoder(twin).encode_many(iter(events[:1])) == encoder(twin).encode(events[0])
    assert encoder(twin).encode_many([]) == b""


@pytest.mark.parametrize("index", [1, 15])
def test_choice_index_on_every_choice_chunk(twin: TwinSet, index: int) -> None:
    lp = LogprobsDelta((TokenLogprob("a", -0.5, None),))
    events = [ContentDelta("a"), lp, ReasoningDelta("r"), ToolCallDelta(0, "{", id="call_1", name="f"),
              ToolCallDelta(0, "}"), Finish("tool_calls"), Usage(3, 4), StreamFailure("x"), Profile({})]
    enc, ref = encoder(twin, index=index), encoder(twin)
    assert enc.index == index and ref.index == 0
    got = frames(enc.encode_many(events))
    assert [c["choices"][0]["index"] for c in got if c.get("choices")] == [index] * 5
    # the same chunks as choice 0's, but for the index
    want = frames(ref.encode_many(events))
    for c in want:
        for choice in c.get("choices", ()):
            choice["index"] = index
    assert got == want
    assert got[0]["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1", None])
def test_choice_index_must_be_a_non_negative_int(twin: TwinSet, bad: Any) -> None:
    with pytest.raises(ValueError, match="choice index"):
        encoder(twin, index=bad)


def test_interleaved_choices_accumulate(twin: TwinSet) -> None:
    encs = [encoder(twin, index=i) for i in range(3)]
    steps = [[(0, [ContentDelta("a")]), (2, [ContentDelta("c")])],
             [(1, [ToolCallDelta(0, '{"x"', id="call_9", name="f")]), (0, [ContentDelta("A")])],
             [(1, [ToolCallDelta(0, ":1}"), Finish("tool_calls")]), (2, [Finish("length")])],
             [(0, [Finish("stop")])]]
    body = b"".join(encs[i].encode_many(events) for step in steps for i, events in step)
    body += encs[0].encode(Usage(5, 6)) + encs[0].done()
    result = twin.accumulate.accumulate([body])
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    assert [c["finish_reason"] for c in result["choices"]] == ["stop", "tool_calls", "length"]
    assert [c["message"]["content"] for c in result["choices"]] == ["aA", None, "c"]
    assert result["choices"][1]["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x":1}'}
    assert result["usage"]["total_tokens"] == 11
    chunks = list(sdk_stream(body))
    assert [c.choices[0].index for c in chunks if c.choices] == [0, 2, 1, 0, 1, 1, 2, 0]
    assert all(c.choices[0].delta.role == "assistant" for c in chunks[:3])


def test_not_an_event(twin: TwinSet) -> None:
    with pytest.raises(TypeError):
        encoder(twin).encode("text")  # type: ignore[arg-type]


# -- Hypothesis: twins are byte-identical --------------------------------------

text = st.text(alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=20)
event = st.one_of(
    st.builds(ContentDelta, text),
    st.builds(ReasoningDelta, text),
    st.builds(ToolCallDelta, st.integers(0, 3), text),
    st.builds(ToolCallDelta, st.integers(0, 3), text, id=st.just("call_1"), name=text),
    st.builds(Finish, st.sampled_from(["stop", "length", "tool_calls", "cancelled"])),
    st.builds(Usage, st.integers(0, 10**6), st.integers(0, 10**6)),
    st.builds(Profile, st.dictionaries(text, text, max_size=2), st.booleans()),
    st.builds(StreamFailure, text),
    st.builds(LogprobsDelta, st.lists(st.builds(TokenLogprob, text, st.floats(), st.none()), max_size=2).map(tuple)),
)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(event, max_size=8), fp=st.one_of(st.none(), text), model=text,
       index=st.integers(0, 20))
def test_twins_identical_and_parse_back(events: list[Any], fp: str | None, model: str, index: int) -> None:
    c = C.sse.SSEEncoder("chatcmpl-x", 1, model, system_fingerprint=fp, index=index)
    py = PY.sse.SSEEncoder("chatcmpl-x", 1, model, system_fingerprint=fp, index=index)
    ref = PY.sse.SSEEncoder("chatcmpl-x", 1, model, system_fingerprint=fp, index=index)
    data = c.encode_many(events)
    assert data == py.encode_many(events)
    assert frames(data) == json.loads(json.dumps(ref.chunks(events), allow_nan=False))


# -- the official SDK as a client ----------------------------------------------


def sdk_stream(body: bytes) -> Any:
    import httpx2
    from openai import OpenAI
    from openai._streaming import Stream
    from openai.types.chat import ChatCompletionChunk

    client = OpenAI(api_key="test", base_url="http://127.0.0.1:9/v1")
    request = httpx2.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
    response = httpx2.Response(200, content=body, request=request, headers={"content-type": "text/event-stream"})
    return Stream(cast_to=ChatCompletionChunk, response=response, client=client)


def test_openai_sdk_parses_our_stream(twin: TwinSet) -> None:
    from openai.types.chat import ChatCompletionChunk

    enc = encoder(twin)
    body = enc.encode_many(
        [
            ReasoningDelta("think"),
            ContentDelta("Hello 中文"),
            ToolCallDelta(0, '{"a"', id="call_1", name="f"),
            ToolCallDelta(0, ":1}"),
            Finish("tool_calls"),
            Usage(3, 5),
        ]
    ) + enc.done()
    chunks = list(sdk_stream(body))
    assert len(chunks) == 6
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "Hello 中文"
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks[2:4]]
    assert calls[0].id == "call_1" and calls[0].function.name == "f"
    assert "".join(c.function.arguments for c in calls) == '{"a":1}'
    assert chunks[4].choices[0].finish_reason == "tool_calls"
    assert chunks[5].choices == [] and chunks[5].usage.total_tokens == 8


def test_openai_sdk_raises_on_error_chunk(twin: TwinSet) -> None:
    import openai

    enc = encoder(twin)
    body = enc.encode(ContentDelta("partial")) + enc.encode(StreamFailure("GPU fell over")) + enc.done()
    stream = sdk_stream(body)
    assert next(stream).choices[0].delta.content == "partial"
    with pytest.raises(openai.APIError, match="GPU fell over"):
        next(stream)
