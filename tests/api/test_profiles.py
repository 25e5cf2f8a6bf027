"""The engine's one ``Profile`` event (``X-AFM-Profile``) in each wire API's own form.

Completions: chat's ``{"afm_profile": ...}`` chunk after the usage, and a
top-level field when collected.  Anthropic: an ``afm_profile`` event between
``message_delta`` and ``message_stop``, and a top-level field of the message.
Responses: an ``afm.profile`` event just before the terminal event, and a
top-level field of the Response object.  Oracles: the SDKs' own parsers and
stream accumulators, fed the translations' events (or bytes).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import anthropic
import httpx2
import pytest
import trio
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types import Completion
from openai.types.responses import Response, ResponseStreamEvent

from afm_core import ContentDelta, Finish, Profile, StreamFailure, Usage
from afm_core.api import completions, responses
from afm_core.api.anthropic import MessageStream

PAYLOAD = {"prefill_tok_s": 123.0, "decode_tok_s": 45.6, "ttft_s": 0.01, "prompt_tokens": 3}
EXTENDED = {"summary": PAYLOAD, "samples": [{"t": 0.1, "phase": "decode", "tokens": 1}]}


def profile(extended: bool = False) -> Profile:
    return Profile(EXTENDED if extended else PAYLOAD, extended)


def key(extended: bool) -> str:
    return "afm_profile_extended" if extended else "afm_profile"


# -- completions ---------------------------------------------------------------------


def cmpl_writer(body: dict[str, Any]) -> completions.CompletionWriter:
    return completions.CompletionWriter(completions.parse(body), id="cmpl-1", created=5, model="m")


@pytest.mark.parametrize("extended", [False, True])
def test_completions_profile_follows_the_usage_and_is_collected(extended: bool) -> None:
    w = cmpl_writer({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    chunks = w.feed(0, [ContentDelta("ab")])
    chunks += w.feed(0, [Finish("stop"), Usage(3, 2), profile(extended)])
    assert chunks[-1] == {key(extended): EXTENDED if extended else PAYLOAD}  # no choices: chat's form
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["total_tokens"] == 5
    assert chunks[-3]["choices"][0]["finish_reason"] == "stop"
    collected = completions.collect(chunks)
    assert collected[key(extended)] == (EXTENDED if extended else PAYLOAD)
    assert collected["choices"][0]["text"] == "ab" and collected["usage"]["total_tokens"] == 5
    # the SDK's Completion keeps the extra top-level field
    assert Completion.model_validate(collected).model_extra == {key(extended): collected[key(extended)]}
    # the SSE frames: the profile frame after the usage frame, then [DONE] is the route's
    frames = [json.loads(line[6:]) for line in completions.encode(chunks).decode().split("\n\n")
              if line.startswith("data: ")]
    assert frames == chunks


def test_completions_profile_without_usage_is_the_last_chunk() -> None:
    w = cmpl_writer({"prompt": "x", "stream": True})
    chunks = w.feed(0, [ContentDelta("a"), Finish("stop"), Usage(1, 1), profile()])
    assert chunks[-1] == {"afm_profile": PAYLOAD} and all("usage" not in c for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_completions_choice_zeros_profile_waits_for_every_choice_and_the_usage() -> None:
    w = cmpl_writer({"prompt": "x", "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    first = w.feed(0, [ContentDelta("a"), Finish("stop"), Usage(3, 1), profile()])
    assert not any("afm_profile" in c for c in first)  # choice 1 still runs
    last = w.feed(1, [ContentDelta("b"), Finish("stop"), Usage(3, 1)])
    assert last[-2]["usage"]["completion_tokens"] == 2 and last[-1] == {"afm_profile": PAYLOAD}
    collected = completions.collect(first + last)
    assert collected["afm_profile"] == PAYLOAD and len(collected["choices"]) == 2


def test_completions_no_profile_after_a_failure() -> None:
    w = cmpl_writer({"prompt": "x", "n": 2, "stream": True})
    chunks = w.feed(0, [Finish("stop"), Usage(3, 1), profile()])
    chunks += w.feed(1, [StreamFailure("broke")])
    assert "error" in chunks[-1] and not any("afm_profile" in c for c in chunks)
    with pytest.raises(Exception, match="broke"):
        completions.collect(chunks)


def test_completions_without_a_profile_is_unchanged() -> None:
    w = cmpl_writer({"prompt": "x"})
    chunks = w.feed(0, [ContentDelta("a"), Finish("stop"), Usage(1, 1)])
    collected = completions.collect(chunks)
    assert "afm_profile" not in collected and "afm_profile_extended" not in collected


# -- anthropic -----------------------------------------------------------------------


def msg_run(w: MessageStream, *batches: list[object], close: bool = True) -> list[dict[str, Any]]:
    out = w.start()
    for batch in batches:
        out += w.feed_many(batch)
    if close:
        out += w.close()
    return out


def names(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


@pytest.mark.parametrize("extended", [False, True])
def test_anthropic_profile_event_between_message_delta_and_message_stop(extended: bool) -> None:
    w = MessageStream(model="claude-x", input_tokens=3, id="msg_1", profile=True)
    events = msg_run(w, [ContentDelta("Hi")], [Finish("stop"), Usage(3, 2, 1), profile(extended)])
    assert names(events)[-3:] == ["message_delta", "afm_profile", "message_stop"]
    assert events[-2] == {"type": "afm_profile", key(extended): EXTENDED if extended else PAYLOAD}
    message = w.message()
    assert message[key(extended)] == (EXTENDED if extended else PAYLOAD)
    parsed = anthropic.types.Message.model_validate(message)  # the SDK keeps the extra field
    assert parsed.model_extra == {key(extended): message[key(extended)]}
    assert parsed.content[0].text == "Hi" and parsed.stop_reason == "end_turn"  # type: ignore[union-attr]


def test_anthropic_message_stop_waits_for_the_profile() -> None:
    w = MessageStream(model="m", profile=True)
    events = msg_run(w, [ContentDelta("a"), Finish("stop"), Usage(1, 1)], close=False)
    assert names(events)[-1] == "message_delta" and not w.ended
    assert w.feed(Usage(1, 1)) == []  # nothing is sent twice
    tail = w.feed(profile())
    assert names(tail) == ["afm_profile", "message_stop"] and w.ended
    assert w.close() == [] and w.feed(profile(True)) == []


def test_anthropic_a_profile_that_never_comes_does_not_hold_the_stop() -> None:
    w = MessageStream(model="m", profile=True)
    events = msg_run(w, [ContentDelta("a"), Finish("length"), Usage(1, 1)])
    assert names(events)[-2:] == ["message_delta", "message_stop"]
    assert "afm_profile" not in w.message() and w.message()["stop_reason"] == "max_tokens"


def test_anthropic_no_profile_after_a_failure_nor_after_message_stop() -> None:
    w = MessageStream(model="m", profile=True)
    events = msg_run(w, [ContentDelta("a"), StreamFailure("broke"), profile()])
    assert names(events)[-1] == "error" and "afm_profile" not in names(events)
    w = MessageStream(model="m")  # not asked: the stop does not wait, a late profile has no place
    events = msg_run(w, [Finish("stop"), Usage(1, 1), profile()])
    assert names(events)[-1] == "message_stop" and "afm_profile" not in names(events)
    assert "afm_profile" not in w.message()


def sdk_client(body: bytes) -> anthropic.AsyncAnthropic:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return anthropic.AsyncAnthropic(api_key="x", base_url="http://afm.test", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))


def test_anthropic_sdk_stream_helper_and_raw_stream_pass_the_profile_event() -> None:
    w = MessageStream(model="claude-x", input_tokens=3, profile=True)
    body = w.encode(msg_run(w, [ContentDelta("Hello")], [Finish("stop"), Usage(3, 1), profile()]))
    assert b"event: afm_profile\ndata: " in body
    want = w.message()

    async def main() -> None:
        client = sdk_client(body)
        async with client.messages.stream(model="claude-x", max_tokens=10,
                                          messages=[{"role": "user", "content": "x"}]) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
        assert kinds[-3:] == ["message_delta", "afm_profile", "message_stop"]
        assert final.content[0].text == "Hello" and final.stop_reason == "end_turn"  # type: ignore[union-attr]
        assert final.usage.output_tokens == want["usage"]["output_tokens"]
        raw = await client.messages.create(model="claude-x", max_tokens=10, stream=True,
                                           messages=[{"role": "user", "content": "x"}])
        got = [event async for event in raw]
        extra = [e for e in got if e.type == "afm_profile"]  # type: ignore[comparison-overlap]
        assert len(extra) == 1 and extra[0].model_extra == {"afm_profile": PAYLOAD}
        assert [e.type for e in got][-1] == "message_stop"
        await client.close()

    trio.run(main)


# -- responses -----------------------------------------------------------------------


def resp_writer(body: dict[str, Any], *, profiled: bool = True) -> responses.ResponseWriter:
    counters: dict[str, int] = {}

    def ids(prefix: str) -> str:
        counters[prefix] = counters.get(prefix, 0) + 1
        return f"{prefix}_{counters[prefix]}"

    return responses.ResponseWriter(responses.parse(body), id="resp_1", created_at=100, model="m",
                                    clock=lambda: 123.0, ids=ids, profile=profiled)


def resp_run(w: responses.ResponseWriter, *steps: list[tuple[int, list[Any]]]) -> list[dict[str, Any]]:
    out = w.start()
    for step in steps:
        for choice, batch in step:
            out += w.feed(batch, choice)
    out += w.end()
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def sdk_accumulate(events: list[dict[str, Any]]) -> Any:
    """What ``client.responses.stream`` runs over the events: each parsed as the SDK
    parses a stream's, then its accumulator; the final (parsed) Response."""
    state: Any = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        parsed = construct_type(type_=ResponseStreamEvent, value=copy.deepcopy(event))
        state.handle_event(parsed)
    assert state._completed_response is not None
    return state._completed_response


def with_cache_writes(response: dict[str, Any]) -> dict[str, Any]:
    response = copy.deepcopy(response)
    response["usage"]["input_tokens_details"]["cache_write_tokens"] = 0
    return response


@pytest.mark.parametrize("extended", [False, True])
def test_responses_profile_event_before_completed_and_on_the_response(extended: bool) -> None:
    w = resp_writer({"input": "hi", "stream": True})
    out = resp_run(w, [(0, [ContentDelta("Hel")])], [(0, [ContentDelta("lo"), Finish("stop"), Usage(3, 2),
                                                           profile(extended)])])
    kinds = names(out)
    assert kinds[-3:] == ["response.output_item.done", "afm.profile", "response.completed"]
    event = out[-2]
    assert event == {"type": "afm.profile", key(extended): EXTENDED if extended else PAYLOAD,
                     "sequence_number": len(out) - 2}
    final = out[-1]["response"]
    assert final == w.response and final[key(extended)] == event[key(extended)]
    assert "afm_profile" not in out[0]["response"]  # not before it arrived
    parsed = Response.model_validate(with_cache_writes(final))
    assert parsed.output_text == "Hello" and (parsed.model_extra or {})[key(extended)] == event[key(extended)]
    got = sdk_accumulate(out)  # the SDK's stream helper: the unknown event is skipped
    assert got.output_text == "Hello" and got.model_extra[key(extended)] == event[key(extended)]
    # as the SDK parses the event itself (responses.create(stream=True))
    sdk_event: Any = construct_type(type_=ResponseStreamEvent, value=copy.deepcopy(event))
    assert sdk_event.type == "afm.profile" and sdk_event.sequence_number == event["sequence_number"]


def test_responses_incomplete_and_cancelled_carry_the_profile_too() -> None:
    w = resp_writer({"input": "hi", "max_output_tokens": 1, "stream": True})
    out = resp_run(w, [(0, [ContentDelta("a"), Finish("length"), Usage(3, 1), profile()])])
    assert names(out)[-2:] == ["afm.profile", "response.incomplete"]
    assert out[-1]["response"]["afm_profile"] == PAYLOAD
    w = resp_writer({"input": "hi"})
    resp_run(w, [(0, [ContentDelta("a"), Finish("cancelled"), Usage(3, 1), profile()])])
    assert w.response["status"] == "cancelled" and w.response["afm_profile"] == PAYLOAD


def test_responses_terminal_waits_for_the_profile_then_is_released() -> None:
    w = resp_writer({"input": "hi", "stream": True})
    out = w.start() + w.feed([ContentDelta("a"), Finish("stop"), Usage(1, 1)])
    assert names(out)[-1] == "response.output_item.done" and not w.done and w.ended(0)
    tail = w.feed([profile()])
    assert names(tail) == ["afm.profile", "response.completed"] and w.done
    # one that never comes: the stream's end releases the terminal event
    w = resp_writer({"input": "hi", "stream": True})
    w.start()
    w.feed([ContentDelta("a"), Finish("stop"), Usage(1, 1)])
    assert names(w.close()) == ["response.completed"] and "afm_profile" not in w.response


def test_responses_n_profile_is_choice_zeros_just_before_the_terminal_event() -> None:
    w = resp_writer({"input": "hi", "n": 2, "stream": True})
    out = resp_run(w,
                   [(0, [ContentDelta("a"), Finish("stop"), Usage(3, 1), profile()]), (1, [ContentDelta("b")])],
                   [(1, [Finish("stop"), Usage(3, 1)])])
    kinds = names(out)
    assert kinds.count("afm.profile") == 1 and kinds[-2:] == ["afm.profile", "response.completed"]
    assert out[-1]["response"]["afm_profile"] == PAYLOAD and out[-1]["response"]["usage"]["output_tokens"] == 2
    got = sdk_accumulate(out)
    assert [o.model_extra["choice_index"] for o in got.output] == [0, 1]
    assert got.model_extra["afm_profile"] == PAYLOAD


def test_responses_no_profile_after_a_failure() -> None:
    w = resp_writer({"input": "hi", "n": 2, "stream": True})
    out = resp_run(w, [(0, [Finish("stop"), Usage(3, 1), profile()])], [(1, [StreamFailure("broke")])])
    assert names(out)[-1] == "response.failed" and "afm.profile" not in names(out)
    assert "afm_profile" not in out[-1]["response"] and "afm_profile" not in w.response


def test_responses_without_a_profile_is_unchanged() -> None:
    w = resp_writer({"input": "hi"}, profiled=False)
    out = resp_run(w, [(0, [ContentDelta("a"), Finish("stop"), Usage(1, 1)])])
    assert names(out)[-1] == "response.completed" and "afm.profile" not in names(out)
    assert "afm_profile" not in w.response
