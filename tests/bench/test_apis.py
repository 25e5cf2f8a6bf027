"""afm bench's wire APIs: request bodies, and each API's stream read the same way."""

from __future__ import annotations

import json

import pytest

from afm_core.bench._apis import APIS, PATHS, body, prompt_text, read_event
from afm_core.bench._loadgen import StreamObserver, Target
from afm_core.bench._results import RequestResult
from afm_core.bench._workload import Job

JOB = Job(index=0, messages=({"role": "system", "content": "be brief"},
                             {"role": "user", "content": "Continue this text."}), max_tokens=7)


def test_bodies_carry_the_same_job_in_each_api() -> None:
    chat = body(JOB, "chat", model="m")
    assert chat["messages"][1]["content"] == "Continue this text." and chat["max_tokens"] == 7
    comp = body(JOB, "completions", model="m")
    assert comp["prompt"] == prompt_text(JOB) == "be brief\n\nContinue this text."
    assert comp["stream_options"] == {"include_usage": True} and comp["model"] == "m"
    msg = body(JOB, "messages", model=None)
    assert msg["system"] == "be brief" and msg["model"] == "afm"
    assert [m["role"] for m in msg["messages"]] == ["user"] and msg["max_tokens"] == 7
    resp = body(JOB, "responses", model="m")
    assert resp["max_output_tokens"] == 7 and resp["store"] is False and len(resp["input"]) == 2
    for api in APIS:
        assert body(JOB, api, model="m")["temperature"] == 0.0
        assert Target("t", "http://127.0.0.1:1", api=api).path == PATHS[api]
    with pytest.raises(ValueError):
        body(JOB, "embeddings", model=None)


# One stream per API: two token-bearing events, usage of 2 output tokens, an end.
STREAMS = {
    "chat": [{"choices": [{"delta": {"role": "assistant"}}]},
             {"choices": [{"delta": {"content": "a"}}]},
             {"choices": [{"delta": {"content": "b"}, "finish_reason": "stop"}]},
             {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}, "[DONE]"],
    "completions": [{"choices": [{"text": "a", "index": 0}]},
                    {"choices": [{"text": "b", "index": 0, "finish_reason": "length"}]},
                    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
                    "[DONE]"],
    "messages": [{"type": "message_start", "message": {"usage": {"input_tokens": 5}}},
                 {"type": "ping"},
                 {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
                 {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a"}},
                 {"type": "content_block_delta", "index": 0,
                  "delta": {"type": "input_json_delta", "partial_json": "{"}},
                 {"type": "content_block_stop", "index": 0},
                 {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                  "usage": {"output_tokens": 2}},
                 {"type": "message_stop"}],
    "responses": [{"type": "response.created", "response": {}},
                  {"type": "response.output_text.delta", "delta": "a"},
                  {"type": "response.function_call_arguments.delta", "delta": "{"},
                  {"type": "response.output_text.done", "text": "a"},
                  {"type": "response.completed",
                   "response": {"usage": {"input_tokens": 5, "output_tokens": 2}}}],
}


@pytest.mark.parametrize("api", APIS)
def test_every_api_stream_gives_the_same_timings(api: str) -> None:
    r = RequestResult(index=0, start=0.0)
    obs = StreamObserver(r, 0.0, api=api)
    now = 0.0
    for event in STREAMS[api]:
        now += 1.0
        obs.data(event if isinstance(event, str) else json.dumps(event), now)
    obs.finish(now + 1)
    assert r.error is None, r.detail
    assert r.output_tokens == 2 and r.prompt_tokens == 5
    assert r.ttft is not None and len(r.itls) == 1


@pytest.mark.parametrize(("api", "event"), [
    ("chat", {"error": {"message": "boom"}}),
    ("completions", {"choices": [{"text": "", "finish_reason": "error"}]}),
    ("messages", {"type": "error", "error": {"type": "api_error", "message": "boom"}}),
    ("responses", {"type": "response.failed", "response": {"error": {"message": "boom"}}}),
])
def test_every_api_reports_a_mid_stream_error(api: str, event: dict) -> None:
    assert read_event(api, event).error


def test_an_unfinished_stream_is_an_error_in_every_api() -> None:
    for api in APIS:
        r = RequestResult(index=0, start=0.0)
        obs = StreamObserver(r, 0.0, api=api)
        obs.data(json.dumps(STREAMS[api][1]), 1.0)
        obs.finish(2.0)
        assert r.error == "no_done", api
