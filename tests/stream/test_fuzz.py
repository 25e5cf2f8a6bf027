"""Arbitrary model text through the whole sans-IO stream core, at random boundaries.

reasoning splitter -> tool-call tracker (every format) -> structured-output
sanitizer -> SSE encoder -> bytes split anywhere -> chunk accumulator.  Text
is built from the tags the parsers look for (``<think>``, ``<tool_call>``,
``<function=``, ``[TOOL_CALLS]``, fences ...), broken JSON and unclosed calls.
Nothing may raise (model output is never an error: malformed calls become
content or ``tracker.errors``, validation is reported), and the accumulated
response must hold exactly what the events said.  The accumulator, fed
arbitrary bytes, raises only its documented ``StreamProtocolError`` family.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afm_core._errors import StreamProtocolError
from afm_core._stream.accumulate import ChunkAccumulator
from afm_core._stream.events import (
    ContentDelta,
    Finish,
    ReasoningDelta,
    StreamFailure,
    ToolCallDelta,
    Usage,
)
from afm_core._stream.reasoning import ReasoningSplitter
from afm_core._stream.sse import SSEEncoder
from afm_core._stream.structured import make_structured_output
from afm_core._stream.toolcalls.registry import FORMATS, make_tool_tracker
from afm_core.api.chat_request import ChatRequest
from tests.stream.helpers import random_split

PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>",
          "<parameter=", "</parameter>", "[TOOL_CALLS]", "<|python_tag|>", "```json\n", "```", "\n",
          '{"name": "get", "arguments": {"a": 1}}', '{"name": "nope", "arguments": ', '{"name": "get", ',
          '"arguments": "{\\"x\\": 2}"}', '{"a": [1, {"b": "c\\"}"}]', "{", "}", "[", "]", '"', "\\", ",",
          ":", "get>", "a>", "value", " ", "null", "true", "1e5", "\u00e9", "\U0001f600", "\x00", "{{",
          '[{"name": "get", "arguments": {}}]', "<tool_call>\n{\"name\": \"get\"", "\ud800"]
text_piece = st.one_of(st.sampled_from(PIECES), st.text(max_size=6))
model_text = st.lists(text_piece, max_size=30).map("".join)
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}]
FORMATS_ = [pytest.param(f, id=f) for f in FORMATS]

core = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run_chain(pieces: list[str], *, fmt: str | None, tools: Any, parallel: bool,
              response_format: dict[str, Any] | None, started: bool, enabled: bool) -> tuple[list[Any], Any]:
    reasoning = ReasoningSplitter("<think>", "</think>", started=started, enabled=enabled)
    tracker = make_tool_tracker(fmt, tools=tools, parallel_tool_calls=parallel) if fmt else None
    structured = make_structured_output(response_format)
    events: list[Any] = []

    def content(evs: list[Any]) -> None:
        for ev in evs:
            if type(ev) is ContentDelta and structured is not None:
                events.extend(structured.feed(ev.text))
            else:
                events.append(ev)

    def stage(evs: list[Any]) -> None:
        for ev in evs:
            if type(ev) is ContentDelta and tracker is not None:
                content(tracker.feed(ev.text))
            elif type(ev) is ContentDelta:
                content([ev])
            else:
                events.append(ev)

    for piece in pieces:
        stage(reasoning.feed(piece))
    stage(reasoning.flush())
    if tracker is not None:
        content(tracker.flush())
    if structured is not None:
        events.extend(structured.flush())
    return events, tracker


@pytest.mark.parametrize("fmt", [None, *FORMATS_])
@core
@given(text=model_text, data=st.data(), parallel=st.booleans(), named=st.booleans(),
       started=st.booleans(), enabled=st.booleans(),
       rf=st.sampled_from([None, {"type": "json_object"},
                           {"type": "json_schema", "json_schema": {"schema": {"type": "object",
                                                                              "required": ["a"]}}}]))
def test_arbitrary_text_through_the_whole_core(fmt: str | None, text: str, data: st.DataObject,
                                               parallel: bool, named: bool, started: bool, enabled: bool,
                                               rf: dict[str, Any] | None) -> None:
    events, tracker = run_chain(random_split(data, text), fmt=fmt, tools=TOOLS if named else None,
                                parallel=parallel, response_format=rf, started=started, enabled=enabled)
    for ev in events:
        assert type(ev) in (ContentDelta, ReasoningDelta, ToolCallDelta), ev
    if tracker is not None:
        assert all(isinstance(e.message, str) for e in tracker.errors)
        if named:  # only the request's names are turned into calls
            assert {ev.name for ev in events if type(ev) is ToolCallDelta and ev.name} <= {"get", "a"}
        if not parallel:
            assert {ev.index for ev in events if type(ev) is ToolCallDelta} <= {0}
    if rf is None and fmt is None and not enabled:  # tags pass through verbatim
        assert "".join(ev.text for ev in events if type(ev) is not ToolCallDelta) == text
    finish = Finish("tool_calls" if tracker is not None and tracker.saw_tool_call else "stop")
    events = [*events, finish, Usage(3, len(events), 0)]

    # SSE encoder -> bytes split anywhere -> accumulator == what the events said
    enc = SSEEncoder("chatcmpl-x", 1, "m")
    wire = enc.encode_many(events[:len(events) // 2]) + b"".join(enc.encode(e) for e in events[len(events) // 2:])
    wire += enc.done()
    acc = ChunkAccumulator()
    for piece in random_split(data, wire.decode("utf-8", "surrogatepass")):
        acc.feed_bytes(piece.encode("utf-8", "surrogatepass"))
    assert acc.done
    msg = acc.result()["choices"][0]["message"]
    want_content = "".join(ev.text for ev in events if type(ev) is ContentDelta)
    want_reasoning = "".join(ev.text for ev in events if type(ev) is ReasoningDelta)
    assert (msg.get("content") or "") == _wire_text(want_content)
    assert (msg.get("reasoning_content") or "") == _wire_text(want_reasoning)
    calls: dict[int, list[str]] = {}
    for ev in events:
        if type(ev) is ToolCallDelta:
            calls.setdefault(ev.index, []).append(ev.arguments)
    got_calls = msg.get("tool_calls") or []
    assert [c["function"]["arguments"] for c in got_calls] == \
        [_wire_text("".join(calls[i])) for i in sorted(calls)]


def _wire_text(text: str) -> str:
    """What survives the wire: a lone surrogate travels as its escape and comes back as-is."""
    return text


@core
@given(data=st.binary(max_size=300) | model_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
       prefix=st.sampled_from([b"", b"data: ", b"data: {", b"data: [DONE]\n\n", b":\n", b"data: {}\n\n"]))
def test_accumulator_raises_only_protocol_errors(data: bytes, prefix: bytes) -> None:
    acc = ChunkAccumulator()
    try:
        acc.feed_bytes(prefix + data)
        acc.feed_bytes(b"\n\n")
        acc.close()
        acc.result()
    except StreamProtocolError:  # incl. StreamErrorChunk
        pass


@core
@given(obj=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                        lambda i: st.lists(i, max_size=3) | st.dictionaries(
                            st.sampled_from(["choices", "delta", "content", "tool_calls", "index",
                                             "function", "arguments", "error", "usage", "finish_reason",
                                             "role", "reasoning_content", "name", "id", "x"]), i, max_size=4),
                        max_leaves=15))
def test_accumulator_on_arbitrary_chunk_shapes(obj: Any) -> None:
    acc = ChunkAccumulator()
    try:
        acc.feed_bytes(b"data: " + json.dumps(obj).encode() + b"\n\ndata: [DONE]\n\n")
        acc.result()
    except StreamProtocolError:
        pass


@core
@given(events=st.lists(st.one_of(
    st.builds(ContentDelta, model_text), st.builds(ReasoningDelta, model_text),
    st.builds(ToolCallDelta, st.integers(0, 3), model_text)), max_size=10))
def test_error_chunk_after_any_prefix_is_reported(events: list[Any]) -> None:
    enc = SSEEncoder("c", 1, "m")
    wire = enc.encode_many(events) + enc.encode(StreamFailure("boom", code="x")) + enc.done()
    acc = ChunkAccumulator()
    with pytest.raises(StreamProtocolError, match="boom"):
        acc.feed_bytes(wire)
        acc.result()


def test_request_validation_raises_only_request_error() -> None:
    from afm_core._errors import RequestError

    base = [{"role": "user", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    bad = [{"messages": [{"role": [], "content": "x"}]},
           {"messages": base, "tools": tools, "tool_choice": {"function": {"name": ["f"]}}},
           {"messages": base, "temperature": 10**400}]
    for body in bad:
        with pytest.raises(RequestError):
            ChatRequest.from_openai(body)
