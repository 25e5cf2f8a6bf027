"""Ollama's translation, pure: bodies into engine requests, events into NDJSON lines
and the response object, and the model shapes; checked against the ``ollama``
client's typed models."""

from __future__ import annotations

import json
from typing import Any

import ollama as client
import pytest

from afm_core import (
    ChatRequest,
    CompletionRequest,
    ContentDelta,
    Finish,
    GenerationError,
    LogprobsDelta,
    Profile,
    ReasoningDelta,
    RequestError,
    StreamFailure,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    UnsupportedError,
    Usage,
)
from afm_core.api import ollama
from afm_core.api.ollama_request import DEFAULT_OPTIONS

USER = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> ChatRequest:
    call = ollama.parse_chat({"model": "m", "messages": USER, **kw})
    assert isinstance(call.request, ChatRequest)
    return call.request


def test_chat_defaults_are_ollamas() -> None:
    call = ollama.parse_chat({"model": "m", "messages": USER})
    assert call.stream is True and call.model == "m" and not call.logprobs
    r = call.request
    assert isinstance(r, ChatRequest)
    assert (r.temperature, r.top_k, r.top_p) == (DEFAULT_OPTIONS["temperature"], DEFAULT_OPTIONS["top_k"],
                                                 DEFAULT_OPTIONS["top_p"])
    assert r.max_tokens is None and r.seed is None and r.tool_choice == "none"
    assert r.enable_thinking is None and r.response_format is None


def test_options_map_onto_the_sampler() -> None:
    r = chat(options={"temperature": 0, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "seed": 42, "num_predict": 7,
                      "stop": ["END", "\n\n"], "repeat_penalty": 1.2, "presence_penalty": 0.5,
                      "frequency_penalty": -0.5, "num_ctx": 8192, "num_gpu": 1, "use_mmap": True,
                      "mirostat": 2, "typical_p": 0.7, "never_heard_of": "it"})
    assert (r.temperature, r.top_p, r.top_k, r.min_p, r.seed, r.max_tokens) == (0, 0.5, 5, 0.1, 42, 7)
    assert r.stop == ("END", "\n\n") and r.repetition_penalty == 1.2
    assert (r.presence_penalty, r.frequency_penalty) == (0.5, -0.5)
    assert chat(options={"seed": -1, "num_predict": -1}).seed is None
    assert chat(options={"num_predict": -2}).max_tokens is None
    assert chat(options={"num_predict": 3.0, "top_k": -1}).max_tokens == 3  # a float integer, as Go takes it
    assert chat(options={"repeat_penalty": 0}).repetition_penalty == 1.0  # 0: off
    assert chat(options={"stop": "X"}).stop == ("X",)


@pytest.mark.parametrize(("options", "message"), [
    ({"temperature": "hot"}, 'option "temperature" must be of type float32'),
    ({"num_predict": "lots"}, 'option "num_predict" must be of type integer'),
    ({"use_mmap": 1}, 'option "use_mmap" must be of type boolean'),
    ({"stop": [1]}, 'option "stop" must be of an array of strings'),
])
def test_option_types_are_checked(options: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message):
        chat(options=options)
    with pytest.raises(RequestError, match="options"):
        chat(options=[1])


def test_think_format_logprobs() -> None:
    assert chat(think=True).enable_thinking is True and chat(think=False).enable_thinking is False
    high = chat(think="max")
    assert high.enable_thinking is True and high.reasoning_effort == "high"
    with pytest.raises(RequestError, match="invalid think value"):
        chat(think="lots")
    assert chat(format="json").response_format == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(format=schema).loose_schema == schema  # enforced by the grammar, best-effort
    assert chat(format="").response_format is None
    with pytest.raises(RequestError, match='expected "json" or a valid JSON Schema'):
        chat(format=[1])
    lp = chat(logprobs=True, top_logprobs=3)
    assert lp.logprobs and lp.top_logprobs == 3
    assert not chat(top_logprobs=3).logprobs  # only with logprobs, as Ollama's
    with pytest.raises(RequestError, match="top_logprobs must be between 0 and 20"):
        chat(logprobs=True, top_logprobs=21)


def test_messages_with_tool_calls_thinking_and_tool_results() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = chat(tools=tools, messages=[
        {"role": "SYSTEM", "content": "be brief"},
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": "", "thinking": "I should call f",
         "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1, "s": "é"}}}]},
        {"role": "tool", "content": "42", "tool_name": "f", "tool_call_id": "call_9"},
    ])
    system, _, assistant, tool = r.messages
    assert system == {"role": "system", "content": "be brief"}  # roles lower-cased, as Ollama does
    assert assistant["reasoning_content"] == "I should call f"
    (call,) = assistant["tool_calls"]
    assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"]) == {"x": 1, "s": "é"}
    assert tool["name"] == "f" and tool["tool_call_id"] == "call_9" and tool["content"] == "42"
    assert r.tools is not None and r.tool_choice == "auto"
    with pytest.raises(UnsupportedError, match="images"):
        chat(messages=[{"role": "user", "content": "see", "images": ["aGk="]}])
    with pytest.raises(RequestError, match="arguments must be an object"):
        chat(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}])


def test_nothing_to_generate_and_missing_model() -> None:
    assert ollama.parse_chat({"model": "m"}).request is None
    assert ollama.parse_chat({"model": "m", "messages": [], "stream": False}).stream is False
    assert ollama.parse_generate({"model": "m", "keep_alive": 0}).request is None
    for parse in (ollama.parse_chat, ollama.parse_generate, ollama.parse_embed):
        with pytest.raises(RequestError, match="model is required"):
            parse({"messages": USER, "prompt": "x", "input": "x"})


def test_generate_bodies() -> None:
    g = ollama.parse_generate({"model": "m", "prompt": "hello", "system": "be kind",
                               "options": {"num_predict": 5}, "think": False, "format": "json"})
    assert isinstance(g.request, ChatRequest)
    assert [m["role"] for m in g.request.messages] == ["system", "user"]
    assert g.request.max_tokens == 5 and g.request.enable_thinking is False
    raw = ollama.parse_generate({"model": "m", "prompt": "<s>x", "raw": True, "logprobs": True,
                                 "top_logprobs": 2})
    assert isinstance(raw.request, CompletionRequest)
    assert raw.request.prompt == "<s>x" and raw.request.max_tokens is None  # not completions' 16
    assert raw.request.logprobs and raw.request.top_logprobs == 2 and raw.logprobs
    assert raw.request.temperature == DEFAULT_OPTIONS["temperature"]
    fim = ollama.parse_generate({"model": "m", "prompt": "def f(", "suffix": "\n    return x"})
    assert isinstance(fim.request, CompletionRequest) and fim.request.suffix == "\n    return x"
    for body, message in [({"raw": True, "system": "s"}, "raw mode does not support"),
                          ({"template": "{{ .Prompt }}"}, "template"),
                          ({"context": [1, 2]}, "context"),
                          ({"raw": True, "format": "json"}, "format"),
                          ({"images": ["aGk="]}, "images")]:
        with pytest.raises(RequestError, match=message):
            ollama.parse_generate({"model": "m", "prompt": "x", **body})


def test_embed_bodies() -> None:
    e = ollama.parse_embed({"model": "m", "input": ["a", "b"], "truncate": False, "dimensions": 4})
    assert e.inputs == ("a", "b") and not e.truncate and e.dimensions == 4
    assert ollama.parse_embed({"model": "m", "input": "a"}).inputs == ("a",)
    assert ollama.parse_embed({"model": "m", "input": ""}).inputs == ()
    assert ollama.parse_embed({"model": "m"}).inputs == ()
    with pytest.raises(RequestError, match="invalid input type"):
        ollama.parse_embed({"model": "m", "input": [1, 2]})
    assert ollama.parse_embeddings({"model": "m", "prompt": "p"}).inputs == ("p",)


# -- the writer ---------------------------------------------------------------------------


class Clock:
    """A clock advancing 1 ms a reading (nanoseconds)."""

    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        self.t += 1_000_000
        return self.t


def writer(**kw: Any) -> ollama.Writer:
    return ollama.Writer(model="m", started=0, loaded=500_000, clock=Clock(), now=lambda: "T", **kw)


def lines(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().splitlines()]


def test_chat_lines_and_the_done_object() -> None:
    w = writer()
    out = lines(w.feed(0, [ContentDelta('He said "hi"')]))
    assert out == [{"model": "m", "created_at": "T", "message": {"role": "assistant", "content": 'He said "hi"'},
                    "done": False}]
    assert lines(w.feed(0, [ReasoningDelta("hm")]))[0]["message"] == {"role": "assistant", "content": "",
                                                                      "thinking": "hm"}
    tail = lines(w.feed(0, [ContentDelta("!"), Finish("length"), Usage(12, 3, 4)]))
    assert tail[0]["message"]["content"] == "!"
    done = tail[-1]
    assert done["done"] is True and done["done_reason"] == "length" and done["message"]["content"] == ""
    assert (done["prompt_eval_count"], done["eval_count"]) == (12, 3)  # cached tokens count too
    assert done["load_duration"] == 500_000 and done["prompt_eval_duration"] == 500_000
    # the clock reads 1 ms at the first step, 2 ms at the finish
    assert done["eval_duration"] == 1_000_000 and done["total_duration"] == 2_000_000
    assert w.done and w.feed(0, [ContentDelta("late")]) == b"" and w.close(0) == b""
    client.ChatResponse(**done)  # the client's typed model takes it


def test_generate_lines_tool_calls_and_profile() -> None:
    w = writer(chat=False)
    assert lines(w.feed(0, [ContentDelta("ab")])) == [{"model": "m", "created_at": "T", "response": "ab",
                                                       "done": False}]
    assert lines(w.feed(0, [ReasoningDelta("t")]))[0] == {"model": "m", "created_at": "T", "response": "",
                                                          "thinking": "t", "done": False}
    t = writer()
    assert t.feed(0, [ToolCallDelta(0, '{"city": ', "call_1", "get_weather")]) == b""  # held until complete
    assert t.feed(0, [ToolCallDelta(0, '"Paris"}'), ToolCallDelta(1, "not json", "call_2", "g")]) == b""
    calls, done = lines(t.feed(0, [Finish("tool_calls"), Usage(5, 9), Profile({"x": 1})]))
    assert calls["message"]["tool_calls"] == [
        {"id": "call_1", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "function": {"index": 1, "name": "g", "arguments": {}}}]
    assert done["done_reason"] == "stop" and done["afm_profile"] == {"x": 1}
    client.ChatResponse(**calls)


def test_logprobs_ride_with_their_text() -> None:
    w = writer(logprobs=True)
    entry = TokenLogprob("a", -0.5, (97,), (TopLogprob("a", -0.5, (97,)), TopLogprob("b", float("-inf"), None)))
    (line,) = lines(w.feed(0, [ContentDelta("a"), LogprobsDelta((entry,))]))
    assert line["logprobs"] == [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "b", "logprob": -9999.0}]}]
    assert "logprobs" not in lines(writer().feed(0, [ContentDelta("a"), LogprobsDelta((entry,))]))[0]


def test_the_non_streamed_object() -> None:
    w = writer(stream=False, logprobs=True)
    entry = TokenLogprob("x", -1.0, None)
    for batch in ([ReasoningDelta("plan")], [ContentDelta("x")], [LogprobsDelta((entry,))],
                  [ToolCallDelta(0, "{}", "call_1", "f")], [Finish("tool_calls"), Usage(3, 4)]):
        assert w.feed(0, batch) == b""
    r = w.result()
    assert r["message"] == {"role": "assistant", "content": "x", "thinking": "plan",
                            "tool_calls": [{"id": "call_1", "function": {"index": 0, "name": "f",
                                                                        "arguments": {}}}]}
    assert r["done"] is True and r["done_reason"] == "stop" and len(r["logprobs"]) == 1
    assert client.ChatResponse(**r).message.tool_calls[0].function.name == "f"
    with pytest.raises(ValueError):
        writer().result()  # a streaming writer keeps no object


def test_failures() -> None:
    w = writer()
    w.feed(0, [ContentDelta("a")])
    assert lines(w.feed(0, [StreamFailure("boom")])) == [{"error": "boom"}]
    assert w.done and w.fail("again") == b""
    cut = writer()
    cut.feed(0, [ContentDelta("a")])
    assert lines(cut.close(0)) == [{"error": "the stream ended before it finished"}]
    late = writer()
    late.feed(0, [Finish("stop")])  # no usage came: the done object at the stream's end
    assert lines(late.close(0))[-1]["done"] is True
    ns = writer(stream=False)
    ns.fail("stream failed: x")
    with pytest.raises(GenerationError, match="stream failed: x"):
        ns.result()
    assert writer().keepalive() == b"" and writer().start() == b"" and writer().end() == b""


def test_model_shapes_parse_in_the_client() -> None:
    facts = ollama.ModelFacts(name="qwen", size=1234, modified_at=1_700_000_000.5, digest="ab" * 32,
                              format="gguf", family="qwen2", parameter_size="494.03M",
                              quantization_level="Q4_K_M", context_length=32768, embedding_length=896,
                              template="{{ messages }}", capabilities=("completion", "tools"))
    tags = client.ListResponse(**ollama.tags_response([facts]))
    assert tags.models[0].model == "qwen" and tags.models[0].details.quantization_level == "Q4_K_M"
    assert tags.models[0].modified_at.year == 2023
    show = client.ShowResponse(**ollama.show_response(facts))
    assert show.modelinfo["qwen2.context_length"] == 32768 and show.capabilities == ["completion", "tools"]
    ps = client.ProcessResponse(**ollama.ps_response([(facts, 1_800_000_000.0, 0)]))
    assert ps.models[0].expires_at.year == 2027 and ps.models[0].context_length == 32768
    assert ollama.version_response("9.9")["afm_version"] == "9.9"
    assert ollama.rfc3339(nanos=1_000_000_001) == "1970-01-01T00:00:01.000000001Z"
    assert ollama.loaded_response("m", chat=True, reason="load")["message"] == {"role": "assistant",
                                                                                "content": ""}
    assert ollama.error_body("nope") == {"error": "nope"}
