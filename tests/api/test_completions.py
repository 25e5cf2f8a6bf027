"""The legacy Completions translation (afm_core.api.completions), without an engine:
body validation into engine requests, events into text_completion chunks, and
the chunks folded back into the non-streaming object."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest

from afm_core import (
    CompletionRequest,
    ContentDelta,
    Finish,
    LogprobsDelta,
    RequestError,
    StreamErrorChunk,
    StreamFailure,
    TokenLogprob,
    TopLogprob,
    UnsupportedError,
    Usage,
)
from afm_core.api import completions as api

# -- parse: prompt forms ------------------------------------------------------------


def test_prompt_forms_give_one_request_per_prompt_in_order() -> None:
    assert [r.prompt for r in api.parse({"prompt": "Once upon"}).requests] == ["Once upon"]
    assert [r.prompt for r in api.parse({"prompt": ["a", "b", "c"]}).requests] == ["a", "b", "c"]
    assert [r.prompt for r in api.parse({"prompt": [5, 6, 7]}).requests] == [(5, 6, 7)]
    call = api.parse({"prompt": [[5, 6], [7], "text"]})
    assert [r.prompt for r in call.requests] == [(5, 6), (7,), "text"]
    assert call.prompt_of == (0, 1, 2)


def test_defaults_follow_openai() -> None:
    call = api.parse({"prompt": "x"})
    (r,) = call.requests
    assert r == CompletionRequest(prompt="x")  # max_tokens 16, temperature 1, no logprobs
    assert r.max_tokens == 16
    assert (call.echo, call.logprobs, call.stream, call.include_usage, call.model) == \
        (False, None, False, False, None)


def test_settings_reach_every_request() -> None:
    body = {"prompt": ["a", "b"], "model": "m", "max_tokens": 0, "temperature": 0, "top_p": 0.5,
            "top_k": 40, "min_p": 0.1, "seed": 7, "stop": ["\n", "END"], "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logit_bias": {"3": -100},
            "ignore_eos": True, "add_special_tokens": False, "stream": True,
            "stream_options": {"include_usage": True}, "user": "ignored", "best_of": 1}
    call = api.parse(body)
    assert call.stream and call.include_usage and call.model == "m"
    for r, p in zip(call.requests, ["a", "b"], strict=True):
        assert r == CompletionRequest(
            prompt=p, model="m", max_tokens=0, temperature=0.0, top_p=0.5, top_k=40, min_p=0.1, seed=7,
            stop=("\n", "END"), presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
            logit_bias={3: -100.0}, ignore_eos=True, add_special_tokens=False)


def test_logprobs_and_echo_map_to_engine_scoring() -> None:
    (r,) = api.parse({"prompt": "x", "logprobs": 3}).requests
    assert (r.logprobs, r.top_logprobs, r.prompt_logprobs) == (True, 3, None)
    call = api.parse({"prompt": "x", "logprobs": 1, "echo": True, "max_tokens": 0})
    (r,) = call.requests
    assert (r.logprobs, r.top_logprobs, r.prompt_logprobs, r.max_tokens) == (True, 1, 1, 0)
    assert call.echo and call.logprobs == 1
    (r,) = api.parse({"prompt": "x", "logprobs": 0, "echo": True}).requests
    assert (r.logprobs, r.top_logprobs, r.prompt_logprobs) == (True, 0, 0)
    # echo alone scores nothing; logprobs false or null is no logprobs
    for body in ({"prompt": "x", "echo": True}, {"prompt": "x", "logprobs": False},
                 {"prompt": "x", "logprobs": None}):
        (r,) = api.parse(body).requests
        assert (r.logprobs, r.prompt_logprobs) == (False, None)


def test_n_numbers_choices_prompt_major_and_varies_the_seed() -> None:
    call = api.parse({"prompt": ["a", "b"], "n": 3, "seed": 10})
    assert [r.prompt for r in call.requests] == ["a"] * 3 + ["b"] * 3
    assert call.prompt_of == (0, 0, 0, 1, 1, 1)
    assert [r.seed for r in call.requests] == [10, 11, 12, 10, 11, 12]
    assert all(r.seed is None for r in api.parse({"prompt": "a", "n": 2}).requests)


# -- parse: errors ---------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ([], "body"),
    ("prompt", "body"),
    ({}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt[1]"),
    ({"prompt": ["ok", 5]}, "prompt[1]"),
    ({"prompt": [[1, 2], []]}, "prompt[1]"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1, True]}, "prompt[1]"),
    ({"prompt": [[1, 2.5]]}, "prompt[0][1]"),
    ({"prompt": [1, 2**31]}, "prompt[1]"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": ["a", None]}, "prompt[1]"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "logprobs": "1"}, "logprobs"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "stream": "true"}, "stream"),
    ({"prompt": "x", "stream_options": []}, "stream_options"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "n": api.MAX_CHOICES + 1}, "n"),
    ({"prompt": ["x"] * 600, "n": 2}, "prompt"),
    ({"prompt": "x", "suffix": 5}, "suffix"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "top_p": "1"}, "top_p"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "ignore_eos": "no"}, "ignore_eos"),
    ({"prompt": "x", "model": 3}, "model"),
])
def test_bad_bodies_are_request_errors_naming_the_field(body: object, param: str) -> None:
    with pytest.raises(RequestError) as info:
        api.parse(body)
    assert info.value.status == 400
    assert info.value.param == param, info.value.message


def test_best_of_other_than_n_is_unsupported() -> None:
    with pytest.raises(UnsupportedError) as info:
        api.parse({"prompt": "x", "best_of": 3})
    assert info.value.param == "best_of" and info.value.status == 400
    assert api.parse({"prompt": "x", "n": 2, "best_of": 2}).choices == 2


# -- the writer ------------------------------------------------------------------------


def lp(token: str, value: float, *tops: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(token, value, tuple(token.encode()),
                        tuple(TopLogprob(t, v, tuple(t.encode())) for t, v in tops))


@dataclass(frozen=True)
class Scored:
    tokens: tuple[str, ...]
    logprobs: tuple[float | None, ...]
    top_logprobs: tuple[tuple[TopLogprob, ...], ...]


def writer(body: dict, echo: tuple[str, ...] = (), **kw: object) -> api.CompletionWriter:
    return api.CompletionWriter(api.parse(body), id="cmpl-1", created=5, model="m", echo=echo, **kw)


def choice(chunk: dict) -> dict:
    assert {k: chunk[k] for k in ("id", "object", "created", "model")} == \
        {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m"}
    (c,) = chunk["choices"]
    return c


def test_text_chunks_finish_and_usage() -> None:
    w = writer({"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}})
    chunks = w.feed(0, [ContentDelta("Hel")])
    chunks += w.feed(0, [ContentDelta("lo"), Finish("length"), Usage(2, 2, 1)])
    assert [choice(c) for c in chunks[:3]] == [
        {"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None},
        {"index": 0, "text": "lo", "logprobs": None, "finish_reason": None},
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"},
    ]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 1}}
    assert w.finished and w.ended(0) and w.error is None
    assert w.feed(0, [ContentDelta("late")]) == []  # nothing follows the end
    assert api.collect(chunks) == {
        "id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}],
        "usage": chunks[3]["usage"]}


def test_usage_only_when_asked_while_streaming_and_always_otherwise() -> None:
    events = [ContentDelta("a"), Finish("stop"), Usage(1, 1)]
    assert all(c["choices"] for c in writer({"prompt": "x", "stream": True}).feed(0, events))
    assert "usage" in writer({"prompt": "x"}).feed(0, events)[-1]


def test_legacy_logprobs_and_text_offsets() -> None:
    w = writer({"prompt": "x", "logprobs": 2})
    chunks = w.feed(0, [ContentDelta(" Par"), LogprobsDelta((lp(" Par", -0.5, (" Par", -0.5), (" Lon", -1.5)),)),
                        LogprobsDelta((lp("\ufffd", -2.0, ("\ufffd", -2.0), ("x", -3.0)),)),
                        ContentDelta("is é"), LogprobsDelta((lp("is é", -math.inf, ("a", 0.25)),))])
    chunks += w.feed(0, [ContentDelta("!"), Finish("stop"), Usage(1, 4)])
    assert choice(chunks[0])["logprobs"] == {"tokens": [" Par"], "token_logprobs": [-0.5],
                                            "top_logprobs": [{" Par": -0.5, " Lon": -1.5}],
                                            "text_offset": [0]}
    # a token whose text is held back still gets its own chunk, text empty
    assert choice(chunks[1])["text"] == "" and choice(chunks[1])["logprobs"]["text_offset"] == [4]
    # clamped: -inf -> -9999, a positive value -> 0
    assert choice(chunks[2])["logprobs"] == {"tokens": ["is é"], "token_logprobs": [-9999.0],
                                            "top_logprobs": [{"a": 0.0}], "text_offset": [5]}
    # flushed text with no token of its own: empty lists
    assert choice(chunks[3])["logprobs"] == {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                            "text_offset": []}
    result = api.collect(chunks)
    (c,) = result["choices"]
    assert c["text"] == " Paris é!"
    assert c["logprobs"]["tokens"] == [" Par", "\ufffd", "is é"]
    assert c["logprobs"]["text_offset"] == [0, 4, 5]
    json.dumps(result, allow_nan=False)  # strict JSON


def test_echo_with_scored_prompt() -> None:
    scored = Scored(tokens=("The", " cat"), logprobs=(None, -1.25),
                    top_logprobs=((), (TopLogprob(" dog", -0.5, None), TopLogprob(" cat", -1.25, None))))
    w = writer({"prompt": [[1, 2]], "echo": True, "logprobs": 2, "max_tokens": 1}, echo=("The cat",))
    chunks = w.feed(0, [ContentDelta(" sat"), LogprobsDelta((lp(" sat", -0.75),)),
                        Finish("length"), Usage(2, 1)], scored)
    echo = choice(chunks[0])
    assert echo == {"index": 0, "text": "The cat", "finish_reason": None, "logprobs": {
        "tokens": ["The", " cat"], "token_logprobs": [None, -1.25],
        "top_logprobs": [None, {" dog": -0.5, " cat": -1.25}], "text_offset": [0, 3]}}
    (c,) = api.collect(chunks)["choices"]
    assert c["text"] == "The cat sat"
    assert c["logprobs"] == {"tokens": ["The", " cat", " sat"], "token_logprobs": [None, -1.25, -0.75],
                             "top_logprobs": [None, {" dog": -0.5, " cat": -1.25}, {}],
                             "text_offset": [0, 3, 7]}


def test_echo_with_nothing_generated_and_without_logprobs() -> None:
    w = writer({"prompt": "abc", "echo": True, "max_tokens": 0}, echo=("abc",))
    (c,) = api.collect(w.feed(0, [Finish("length"), Usage(3, 0)]))["choices"]
    assert c == {"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}
    # cancelled before the prompt was scored: the echo has empty logprobs
    w = writer({"prompt": "abc", "echo": True, "logprobs": 1}, echo=("abc",))
    (c,) = api.collect(w.feed(0, [Finish("cancelled"), Usage(3, 0)]))["choices"]
    assert c["text"] == "abc" and c["logprobs"]["tokens"] == [] and c["finish_reason"] == "cancelled"


def test_several_choices_interleave_and_usage_counts_each_prompt_once() -> None:
    w = writer({"prompt": ["p", "q"], "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    chunks = []
    for i, text in [(2, "c"), (0, "a"), (3, "d"), (1, "b")]:
        chunks += w.feed(i, [ContentDelta(text)])
    for i in range(4):
        assert not w.finished
        chunks += w.feed(i, [Finish("stop"), Usage(10 + i // 2, 1 + i, i // 2)])
    assert w.finished and "usage" in chunks[-1]
    assert sum("usage" in c for c in chunks) == 1
    assert chunks[-1]["usage"]["prompt_tokens"] == 10 + 11  # each prompt once, not per choice
    assert chunks[-1]["usage"]["completion_tokens"] == 1 + 2 + 3 + 4
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    result = api.collect(chunks)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in result["choices"]] == \
        [(0, "a", "stop"), (1, "b", "stop"), (2, "c", "stop"), (3, "d", "stop")]


def test_a_failure_is_an_error_chunk_and_no_usage() -> None:
    w = writer({"prompt": ["p", "q"]})
    chunks = w.feed(0, [ContentDelta("a")])
    chunks += w.feed(1, [StreamFailure("boom", code="generation_failed")])
    assert chunks[-1]["choices"] == [] and chunks[-1]["error"] == {
        "message": "boom", "type": "server_error", "param": None, "code": "generation_failed"}
    assert w.ended(1) and not w.ended(0) and w.error == chunks[-1]["error"]
    assert w.feed(0, [ContentDelta("b"), Finish("stop"), Usage(1, 1)]) == []  # the response failed
    assert not any("usage" in c for c in chunks)
    with pytest.raises(StreamErrorChunk) as info:
        api.collect(chunks)
    assert info.value.code == "generation_failed"
    (err,) = w.fail(StreamFailure("late", code="internal_error"))
    assert err["error"]["message"] == "late" and w.error["message"] == "boom"


def test_encode_frames_parse_back_to_the_chunks() -> None:
    w = writer({"prompt": "x", "stream": True})
    chunks = w.feed(0, [ContentDelta('quote " and \\ and \U0001f680 and \x00'), Finish("stop"),
                        Usage(1, 1)])
    raw = api.encode(chunks) + api.DONE
    frames = raw.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    assert [json.loads(f.removeprefix("data: ")) for f in frames[:-2]] == chunks


def test_the_writer_needs_one_echo_text_per_choice() -> None:
    with pytest.raises(ValueError, match="echo"):
        writer({"prompt": ["a", "b"], "echo": True}, echo=("a",))
