"""Fuzzed bodies against ONE real server's ``/v1/messages`` (hypercorn on 127.0.0.1, echo model).

As ``test_fuzz.py`` does for chat: the server runs in a background thread
(its own ``trio.run``) for the module; Hypothesis tests are synchronous and
use one ``httpx.Client``.  Whatever the body, the answer is never a 5xx:
either a 4xx in Anthropic's envelope (``{"type": "error", "error": {"type",
"message"}, "request_id"}``, the error type matching the status), or a 200
that is a valid ``Message`` (or a valid event stream, each event one of the
SDK's types).  Where a small oracle here knows the answer (a field's range,
a missing field, an unknown field), the result must match it, and a served
echo must be exact.  After each test a normal request is served exactly.
"""

from __future__ import annotations

import json
import os
import string
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afm_http import ServerConfig
from tests.http.fuzz_helpers import (
    MAX_BODY,
    Server,
    client_of,
    encode,
    fuzz_settings,
    json_values,
    num_in,
    post_bytes,
    safe_texts,
    serve_in_thread,
)

MESSAGES = "/v1/messages"
STATUS_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "request_too_large"}
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
STATUSES: dict[str, Counter[int]] = {}  # test -> statuses seen (printed with ``pytest -s``)

fuzz = fuzz_settings(80)


@pytest.fixture(scope="module")
def server(echo_model_dir: Path) -> Iterator[Server]:
    with serve_in_thread(echo_model_dir, "fuzz-anthropic-server", server=ServerConfig(max_body_bytes=MAX_BODY),
                         grammar=False, max_batch=8) as srv:
        yield srv
    stats = srv.final_statistics
    assert (stats.running, stats.requests_active) == (0, 0)  # nothing left generating or registered
    print("\nfuzz_anthropic statuses:", {k: dict(v) for k, v in sorted(STATUSES.items())})


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with client_of(server) as c:
        yield c


@pytest.fixture(autouse=True)
def _normal_after_each_test(client: httpx.Client) -> Iterator[None]:
    yield
    assert_message(post(client, body("still serving normally")), "still serving normally")


def body(text: str = "hello there", **kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": text}], **kw}


def post(client: httpx.Client, obj: Any, path: str = MESSAGES) -> httpx.Response:
    return post_raw(client, encode(obj), path)


def post_raw(client: httpx.Client, raw: bytes, path: str = MESSAGES) -> httpx.Response:
    r = post_bytes(client, path, raw)
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]
    STATUSES.setdefault(test, Counter())[r.status_code] += 1
    return r


def assert_envelope(r: httpx.Response, statuses: tuple[int, ...] = (400,)) -> str:
    """A 4xx in Anthropic's envelope; returns its message."""
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    data = r.json()
    assert set(data) == {"type", "error", "request_id"} and set(data["error"]) == {"type", "message"}
    assert data["type"] == "error" and data["error"]["type"] == STATUS_TYPES[r.status_code]
    assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    assert data["request_id"] == r.headers["request-id"] == r.headers["x-request-id"]
    if r.status_code != 413:  # "request_too_large" (Anthropic's documented 413 type) is not in the SDK's union
        anthropic.types.ErrorResponse.model_validate(data)
    message: str = data["error"]["message"]
    return message


def assert_message(r: httpx.Response, text: str | None = None, *, prefix: bool = False) -> None:
    """A 200 whose body is a valid Message (or event stream); the echo exact if ``text``."""
    assert r.status_code == 200, (r.status_code, r.text[:500])
    if r.headers["content-type"].startswith("text/event-stream"):
        frames = [f.split("\n") for f in r.text.removesuffix("\n\n").split("\n\n")]
        events = [json.loads(data.removeprefix("data: ")) for _, data in frames]
        assert [name.removeprefix("event: ") for name, _ in frames] == [e["type"] for e in events]
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop", events[-2:]
        for e in events:
            if e["type"] != "ping":
                EVENTS.validate_python(e)
        got = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    else:
        message = anthropic.types.Message.model_validate(r.json())
        assert message.stop_reason is not None
        got = "".join(b.text for b in message.content if b.type == "text")
    if text is not None:
        assert text.startswith(got) if prefix else got == text, (got, text)


def assert_answered(r: httpx.Response) -> None:
    """No oracle: a served message or Anthropic's 400, never anything else."""
    if r.status_code == 200:
        assert_message(r)
    else:
        assert_envelope(r)


safe_text = safe_texts(30)
json_scalar, json_value = json_values(int_bound=10**20, text=st.text(max_size=12), keys=st.text(max_size=8),
                                      size=3, max_leaves=8)


@fuzz
@given(raw=st.one_of(
    st.binary(min_size=1, max_size=120),
    st.builds(lambda s, cut: s[:cut], st.just(json.dumps(body("truncated")).encode()), st.integers(1, 40)),
    st.sampled_from([b"{", b"[]", b"null", b"NaN", b'{"max_tokens": Infinity}', b"\xef\xbb\xbf{}",
                     b'{"model": "m",}', b'"\\ud800"']),
    json_value.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
))
def test_not_a_message_body(client: httpx.Client, raw: bytes) -> None:
    assert_envelope(post_raw(client, raw))


# field -> oracle (True: valid); None always means "absent"
_unit = num_in(0, 1)


def _count(lo: int) -> Any:
    def ok(v: Any) -> bool:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        return not isinstance(v, bool) and isinstance(v, int) and v >= lo
    return ok


FIELDS: dict[str, Any] = {
    "temperature": _unit, "top_p": _unit, "top_k": _count(0), "max_tokens": _count(1),
    "stream": lambda v: isinstance(v, bool), "model": lambda v: isinstance(v, str),
    "stop_sequences": lambda v: isinstance(v, list) and len(v) <= 64
    and all(isinstance(s, str) and s for s in v),
    "metadata": lambda v: isinstance(v, dict) and (v.get("user_id") is None or isinstance(v["user_id"], str)),
    "system": lambda v: isinstance(v, str) or (isinstance(v, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in v)),
}
REQUIRED = {"model", "max_tokens"}
field_value = st.one_of(json_value, st.sampled_from(
    [0, 1, -1, 0.5, 1.0, 1.5, 2, 64, 2**31, 2**63, 1e300, 5e-324, True, False, "1", "", [], {}, ["END"], [""],
     {"user_id": "u"}, {"user_id": 5}, [{"type": "text", "text": "sys"}], [{"type": "image"}]]))
VALID: dict[str, Any] = {
    "temperature": st.floats(0, 1), "top_p": st.floats(0, 1), "top_k": st.integers(0, 200),
    "max_tokens": st.one_of(st.integers(1, 100), st.integers(100, 2**40)), "stream": st.booleans(),
    "model": st.text(max_size=20), "stop_sequences": st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "metadata": st.fixed_dictionaries({}, optional={"user_id": st.one_of(st.none(), st.text(max_size=10))}),
    "system": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text(max_size=10)}), max_size=3)),
}


@fuzz
@given(data=st.data(), key=st.sampled_from(sorted(FIELDS)))
def test_field_values(client: httpx.Client, data: st.DataObject, key: str) -> None:
    value = data.draw(st.one_of(VALID[key], field_value))
    obj = body("fuzzed field", **{key: value})
    if key == "max_tokens" and FIELDS[key](value) and value > 64:
        obj["stream"] = True  # a long answer streams, as the SDKs ask for
    r = post(client, obj)
    if value is None:
        if key in REQUIRED:
            assert assert_envelope(r) == f"{key}: Field required"
        else:
            assert_message(r, "fuzzed field")
        return
    if not FIELDS[key](value):
        assert assert_envelope(r).startswith(f"{key}")
        return
    if key == "stop_sequences":
        assert_message(r, "fuzzed field", prefix=True)  # a stop may cut the echo
    elif key == "max_tokens" or key in ("temperature", "top_p", "top_k"):
        assert_message(r, "fuzzed field" if key == "max_tokens" else None, prefix=True)
    else:
        assert_message(r, "fuzzed field")


KNOWN = {"model", "max_tokens", "messages", "system", "stream", "stop_sequences", "temperature", "top_p",
         "top_k", "metadata", "tools", "tool_choice", "thinking", "output_config"}


@fuzz
@given(extra=st.dictionaries(st.text(alphabet=string.ascii_letters + "_", min_size=1, max_size=16)
                             .filter(lambda k: k not in KNOWN), json_value, min_size=1, max_size=5),
       stream=st.booleans())
def test_unknown_fields_are_tolerated(client: httpx.Client, extra: dict[str, Any], stream: bool) -> None:
    assert_message(post(client, {**extra, **body("extra fields", stream=stream)}), "extra fields")


block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(safe_text, json_value)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.one_of(safe_text, json_value)},
                          optional={"content": st.one_of(safe_text, json_value), "is_error": json_value}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.one_of(safe_text, json_value),
                           "name": st.one_of(safe_text, json_value), "input": json_value}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": st.one_of(safe_text, json_value),
                           "signature": st.text(max_size=5)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "redacted_thinking", "wat", ""])},
                          optional={"data": json_value}),
    json_value,
)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), json_value)},
    optional={"content": st.one_of(safe_text, st.lists(block, max_size=3), json_value)})


@fuzz
@given(messages=st.one_of(st.lists(message, min_size=0, max_size=4), json_value), stream=st.booleans())
def test_messages_and_blocks(client: httpx.Client, messages: Any, stream: bool) -> None:
    assert_answered(post(client, {"model": "m", "max_tokens": 32, "stream": stream, "messages": messages}))


text_block = st.builds(lambda t: {"type": "text", "text": t}, safe_text)


@st.composite
def conversation(draw: st.DrawFn) -> tuple[list[Any], str]:
    """Valid alternating turns (text, thinking, tool use and results) ending with a user's
    text; with the text the echo must answer."""
    turns: list[Any] = []
    calls: list[str] = []
    for _ in range(draw(st.integers(0, 2))):
        user_blocks: list[Any] = [{"type": "tool_result", "tool_use_id": c,
                                   "content": draw(st.one_of(safe_text, st.lists(text_block, max_size=2)))}
                                  for c in calls]
        user_blocks += draw(st.lists(text_block, min_size=0 if calls else 1, max_size=2))
        turns.append({"role": "user", "content": user_blocks})
        calls = [f"toolu_{len(turns)}_{i}" for i in range(draw(st.integers(0, 2)))]
        blocks: list[Any] = draw(st.lists(st.one_of(
            text_block, st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": ""}, safe_text),
            st.just({"type": "redacted_thinking", "data": "x"})), max_size=2))
        blocks += [{"type": "tool_use", "id": c, "name": "f", "input": draw(st.dictionaries(
            st.sampled_from("abc"), st.one_of(st.integers(), safe_text), max_size=2))} for c in calls]
        turns.append({"role": "assistant", "content": blocks or draw(safe_text)})
    final = draw(st.lists(safe_text, min_size=1, max_size=3))
    results = [{"type": "tool_result", "tool_use_id": c} for c in calls]
    if not results and len(final) == 1 and draw(st.booleans()):
        turns.append({"role": "user", "content": final[0]})  # the string shorthand
    else:
        turns.append({"role": "user", "content": [*results, *({"type": "text", "text": t} for t in final)]})
    return turns, "\n".join(final)


@fuzz
@given(conv=conversation(), system=st.one_of(st.none(), safe_text), stream=st.booleans())
def test_valid_conversations_are_echoed(client: httpx.Client, conv: tuple[list[Any], str], system: str | None,
                                        stream: bool) -> None:
    turns, last = conv
    obj = {"model": "m", "max_tokens": 200, "stream": stream, "messages": turns}
    if system is not None:
        obj["system"] = system
    assert_message(post(client, obj), last)


tool = st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.sampled_from(["f", "get_weather", "bad name", ""]), json_value),
    "input_schema": st.one_of(st.just({"type": "object"}), json_value),
    "description": st.one_of(safe_text, json_value), "type": st.one_of(st.just("custom"), json_value),
    "strict": json_value})
choice = st.one_of(json_value, st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["auto", "any", "tool", "none"]), json_value)},
    optional={"name": st.one_of(st.sampled_from(["f", "g"]), json_value), "disable_parallel_tool_use": json_value}))
thinking = st.one_of(json_value, st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["enabled", "disabled", "adaptive"]), json_value)},
    optional={"budget_tokens": st.one_of(st.integers(0, 5000), json_value), "display": json_value}))


@fuzz
@given(tools=st.one_of(st.none(), st.lists(tool, max_size=3), json_value), tool_choice=st.one_of(st.none(), choice),
       thinking=st.one_of(st.none(), thinking), stream=st.booleans())
def test_tools_choice_and_thinking(client: httpx.Client, tools: Any, tool_choice: Any, thinking: Any,
                                   stream: bool) -> None:
    obj = body("tools and thinking", stream=stream, max_tokens=2048)
    for key, value in (("tools", tools), ("tool_choice", tool_choice), ("thinking", thinking)):
        if value is not None:
            obj[key] = value
    assert_answered(post(client, obj))


valid_tools = st.lists(st.sampled_from(["f", "get_weather", "read-file_2"]), min_size=1, max_size=3,
                       unique=True).map(lambda names: [{"name": n, "input_schema": {"type": "object"}} for n in names])


@fuzz
@given(data=st.data(), tools=st.one_of(st.none(), valid_tools), stream=st.booleans(),
       thinking=st.one_of(st.none(), st.sampled_from([{"type": "disabled"}, {"type": "adaptive"}]),
                          st.builds(lambda b: {"type": "enabled", "budget_tokens": b}, st.integers(1024, 2047))))
def test_valid_tools_choice_and_thinking(client: httpx.Client, data: st.DataObject, tools: Any, stream: bool,
                                         thinking: Any) -> None:
    obj = body("tools and thinking", stream=stream, max_tokens=2048)
    choices = [{"type": "auto"}, {"type": "none"}]
    if tools:
        choices += [{"type": "any"}, {"type": "tool", "name": tools[-1]["name"]}]
        obj["tools"] = tools
    choice = data.draw(st.one_of(st.none(), st.sampled_from(choices)))
    if choice is not None:
        obj["tool_choice"] = {**choice, **data.draw(st.fixed_dictionaries(
            {}, optional={"disable_parallel_tool_use": st.booleans()}))}
    if thinking is not None:
        obj["thinking"] = thinking
    assert_message(post(client, obj), "tools and thinking")


@fuzz
@given(tail=st.text(alphabet=string.ascii_letters + string.digits + "/_-.", max_size=20),
       method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST"]))
def test_other_paths_and_methods(client: httpx.Client, tail: str, method: str) -> None:
    path = MESSAGES + ("/" + tail if tail else "")
    r = client.request(method, path, content=json.dumps(body("x")),
                       headers={"Content-Type": "application/json"})
    sent = r.request.url.path.rstrip("/")  # the client resolves dot segments ("/v1/messages/." is the route)
    if method == "POST" and sent in (MESSAGES, MESSAGES + "/count_tokens"):
        assert r.status_code == 200
    else:
        assert_envelope(r, (404, 405))


@settings(fuzz, max_examples=20)
@given(size=st.integers(MAX_BODY + 1, 3 * MAX_BODY))
def test_oversized_bodies(client: httpx.Client, size: int) -> None:
    assert_envelope(post(client, body("x" * size)), (413,))
