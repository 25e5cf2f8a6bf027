"""The one writer protocol (``afm_core.api.writer.Writer``), every API's writer alike.

Each wire API's writer is fed the same engine events; the protocol's promises
hold for each (what streams, what ends a response, what a failure does, the
non-streamed object), and chat's folded ``chat.completion`` equals what a
correct client accumulates from its streamed frames (the SSE round trip the
old ``ChatStream.collect()`` made), for random events of several choices.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afm_core import (
    AFMError,
    ChunkAccumulator,
    ContentDelta,
    Finish,
    LogprobsDelta,
    Profile,
    PromptProgress,
    ReasoningDelta,
    StreamFailure,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from afm_core.api import anthropic, chat, completions, ollama, responses
from afm_core.api.writer import INTERRUPTED, SSE_KEEPALIVE, Writer


def make(api: str, stream: bool) -> Writer:
    if api == "chat":
        return chat.Writer(id="chatcmpl-1", created=1, model="m", stream=stream, include_usage=True)
    if api == "completions":
        call = completions.parse({"prompt": "x", "stream": stream})
        return completions.Writer(call, id="cmpl-1", created=1, model="m")
    if api == "messages":
        return anthropic.Writer(anthropic.MessageStream(model="m", input_tokens=3), stream=stream)
    if api == "responses":
        call = responses.parse({"input": "x", "stream": stream, "store": False})
        return responses.Writer(responses.ResponseWriter(call, id="resp_1", created_at=1.0, model="m"))
    return ollama.Writer(model="m", chat=api == "ollama-chat", stream=stream)


APIS = ["chat", "completions", "messages", "responses", "ollama-chat", "ollama-generate"]

TEXT: dict[str, Callable[[dict[str, Any]], str]] = {
    "chat": lambda r: r["choices"][0]["message"]["content"],
    "completions": lambda r: r["choices"][0]["text"],
    "messages": lambda r: "".join(b["text"] for b in r["content"] if b["type"] == "text"),
    "responses": lambda r: "".join(p["text"] for item in r["output"] for p in item.get("content", ())),
    "ollama-chat": lambda r: r["message"]["content"],
    "ollama-generate": lambda r: r["response"],
}
KEEPALIVE = {"chat": SSE_KEEPALIVE, "completions": SSE_KEEPALIVE, "responses": None,
             "messages": b'event: ping\ndata: {"type":"ping"}\n\n', "ollama-chat": b"", "ollama-generate": b""}

STEPS = [[ContentDelta("Hel")], [ContentDelta("lo"), ContentDelta(" there")], [Finish("stop"), Usage(3, 3)]]


def run(writer: Writer, steps: list[list[Any]]) -> bytes:
    out = writer.start()
    for batch in steps:
        out += writer.feed(0, batch)
    return out + writer.end()


@pytest.mark.parametrize("api", APIS)
def test_a_whole_response(api: str) -> None:
    streamed = make(api, True)
    data = run(streamed, STEPS)
    assert b"Hel" in data and b" there" in data
    assert streamed.done and streamed.ended(0)
    assert streamed.feed(0, [ContentDelta("late")]) == b"" and streamed.fail("late") == b""
    assert streamed.close(0) == b""  # it ended: nothing is owed
    assert streamed.media_type == ("application/x-ndjson" if api.startswith("ollama") else "text/event-stream")
    assert not streamed.stop_requested
    folded = make(api, False)
    assert run(folded, STEPS) == b""  # a non-streamed writer writes nothing
    assert TEXT[api](folded.result()) == "Hello there"


@pytest.mark.parametrize("api", APIS)
def test_a_stream_that_ends_without_a_finish_fails(api: str) -> None:
    streamed = make(api, True)
    data = streamed.start() + streamed.feed(0, [ContentDelta("cut")])
    data += streamed.close(0) + streamed.end()
    assert INTERRUPTED.message.encode() in data and streamed.done
    folded = make(api, False)
    folded.feed(0, [ContentDelta("cut")])
    folded.close(0)
    folded.end()
    with pytest.raises(AFMError, match="ended before it finished"):
        folded.result()


@pytest.mark.parametrize("api", APIS)
def test_fail_and_keepalive(api: str) -> None:
    streamed = make(api, True)
    assert b"a" in streamed.start() + streamed.feed(0, [ContentDelta("a")])
    if api == "responses":  # response.in_progress again, the next sequence_number
        ka = streamed.keepalive()
        assert ka.startswith(b"event: response.in_progress\n") and ka.endswith(b"\n\n")
        event = json.loads(ka.split(b"data: ", 1)[1])
        assert event["response"]["status"] == "in_progress" and event["sequence_number"] == 5  # after created, in_progress, item, part, delta
        assert event["response"]["output"][0]["content"][0]["text"] == "a"
    else:
        assert streamed.keepalive() == KEEPALIVE[api]
    failed = streamed.fail("stream failed: boom")
    assert b"stream failed: boom" in failed and streamed.done
    assert streamed.feed(0, [ContentDelta("b"), Finish("stop"), Usage(1, 2)]) == b""  # nothing follows
    assert streamed.end() in (b"", b"data: [DONE]\n\n")
    folded = make(api, False)
    assert folded.keepalive() == b""  # nobody is listening to a non-streamed answer
    folded.feed(0, [ContentDelta("a")])
    folded.fail("stream failed: boom")
    folded.end()
    with pytest.raises(AFMError, match="boom"):
        folded.result()


@pytest.mark.parametrize("api", APIS)
def test_an_error_event_ends_the_response(api: str) -> None:
    streamed = make(api, True)
    data = streamed.start() + streamed.feed(0, [ContentDelta("a"), StreamFailure("the model broke")])
    assert b"the model broke" in data and streamed.done and streamed.ended(0)


def test_anthropic_stop_sequences_ask_the_driver_to_cancel() -> None:
    w = anthropic.Writer(anthropic.MessageStream(model="m", stop_sequences=["STOP"]))
    w.feed(0, [ContentDelta("one STOP two")])
    assert w.stop_requested and not w.done  # the engine's cancelled finish is still to come
    w.feed(0, [Finish("cancelled"), Usage(1, 4)])
    assert w.done and not w.stop_requested


# -- chat's writer ---------------------------------------------------------------------


def frames(data: bytes) -> list[Any]:
    return [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: {")]


def test_chat_choices_interleave_and_share_one_usage() -> None:
    w = chat.Writer(id="c", created=1, model="m", choices=2, include_usage=True)
    out = w.feed(1, [ContentDelta("b")]) + w.feed(0, [ContentDelta("a")])
    out += w.feed(0, [Finish("stop"), Usage(10, 1, 4), Profile({"p": 1})])
    assert not w.done and w.ended(0) and not w.ended(1)
    out += w.feed(1, [Finish("length"), Usage(10, 2, 4)])
    assert w.done
    got = frames(out + w.end())
    assert [c["choices"][0]["index"] for c in got[:4]] == [1, 0, 0, 1]
    usage, profile = got[4:]
    assert usage["usage"]["prompt_tokens"] == 10 and usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 4} and profile == {"afm_profile": {"p": 1}}
    assert (out + w.end()).endswith(b"data: [DONE]\n\n")


def test_a_failing_chat_choice_stops_the_others() -> None:
    w = chat.Writer(id="c", created=1, model="m", choices=2, include_usage=True)
    w.feed(0, [ContentDelta("a"), Finish("stop"), Usage(1, 1)])
    out = w.feed(1, [StreamFailure("boom", code="x")])
    assert frames(out)[-1]["error"]["message"] == "boom" and w.done and w.ended(0) and w.ended(1)
    assert w.feed(1, [ContentDelta("b")]) == b""
    folded = chat.Writer(id="c", created=1, model="m", choices=2, stream=False)
    folded.feed(1, [StreamFailure("boom", code="x")])
    with pytest.raises(AFMError, match="boom") as err:
        folded.result()
    assert err.value.code == "x"


def test_chat_folds_an_empty_answer_and_progress() -> None:
    w = chat.Writer(id="c", created=1, model="m", stream=False)
    w.feed(0, [PromptProgress(3, 3, 0)])
    w.feed(0, [Finish("stop"), Usage(3, 0)])
    (choice,) = w.result()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "", "reasoning_content": None}
    with pytest.raises(ValueError):
        chat.Writer(id="c", created=1, model="m").result()
    with pytest.raises(ValueError):
        chat.Writer(id="c", created=1, model="m", choices=0)


# Random answers of several choices: chat's fold equals a correct client's accumulation.

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=6)
entries = st.builds(lambda t, lp: TokenLogprob(t, lp, tuple(t.encode()), (TopLogprob(t, lp, None),)),
                    texts, st.floats(-50, 0))


@st.composite
def answers(draw: st.DrawFn) -> list[Any]:
    events: list[Any] = []
    calls = 0
    for kind in draw(st.lists(st.sampled_from("crlt"), max_size=12)):
        if kind == "c":
            events.append(ContentDelta(draw(texts)))
        elif kind == "r":
            events.append(ReasoningDelta(draw(texts)))
        elif kind == "l":
            events.append(LogprobsDelta(tuple(draw(st.lists(entries, min_size=1, max_size=2)))))
        else:
            events.append(ToolCallDelta(calls, draw(texts), f"call_{calls}", f"f{calls}"))
            events += [ToolCallDelta(calls, draw(texts)) for _ in range(draw(st.integers(0, 2)))]
            calls += 1
    prompt = draw(st.integers(1, 50))
    return [*events, Finish(draw(st.sampled_from(["stop", "length", "tool_calls", "cancelled"]))),
            Usage(prompt, draw(st.integers(0, 50)), draw(st.integers(0, prompt)))]


@given(st.lists(answers(), min_size=1, max_size=3), st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_chat_fold_equals_the_accumulated_stream(choices: list[list[Any]], rnd: Any) -> None:
    n = len(choices)
    # each choice's events cut into engine steps; the steps of all choices interleaved
    pending: dict[int, list[list[Any]]] = {}
    for i, events in enumerate(choices):
        cuts = sorted(rnd.sample(range(1, len(events)), min(len(events) - 1, rnd.randint(0, 4))))
        bounds = [0, *cuts, len(events)]
        pending[i] = [events[a:b] for a, b in itertools.pairwise(bounds)]
    streamed = chat.Writer(id="c", created=7, model="m", choices=n, include_usage=True)
    folded = chat.Writer(id="c", created=7, model="m", choices=n, stream=False)
    data = b""
    while pending:
        i = rnd.choice(sorted(pending))
        batch = pending[i].pop(0)
        if not pending[i]:
            del pending[i]
        data += streamed.feed(i, batch)
        folded.feed(i, batch)
    assert streamed.done and folded.done
    acc = ChunkAccumulator()
    acc.feed(data + streamed.end())
    acc.close()
    want = acc.result()
    for choice in want["choices"]:
        message = choice["message"]
        if message["content"] is None and not message.get("tool_calls"):
            message["content"] = ""  # the non-streamed answer's "" for an empty one
    assert folded.result() == want
