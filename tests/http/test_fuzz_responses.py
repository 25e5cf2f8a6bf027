"""Fuzzed bad input for the Responses routes against ONE real server (hypercorn on
127.0.0.1, echo model), like ``test_fuzz.py`` does for chat.

The server runs in a background thread (its own ``trio.run``) for the whole
module; the Hypothesis tests are synchronous and use one ``httpx.Client``.
Where a small oracle written here (independent of ``afm_core.api.responses``)
knows whether a body is valid, invalid ones must get a 4xx with OpenAI's
envelope ``{"error": {"message", "type", "param", "code"}}`` naming the
parameter, valid ones a 200 whose echoed text is right; where it does not
(tool and format shapes), the answer must be a 200 or such a 4xx.  Never a
500, never a crash; after each test a normal request is served exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afm_http import ServerConfig
from tests.http.fuzz_helpers import (
    CONTEXT,
    MAX_BODY,
    Server,
    client_of,
    encode,
    fuzz_settings,
    int_in,
    json_values,
    num_in,
    post_bytes,
    serve_in_thread,
)
from tests.http.fuzz_helpers import (
    assert_openai_envelope as assert_envelope,
)

RESPONSES = "/v1/responses"
EXAMPLES = 150

fuzz = fuzz_settings(EXAMPLES)


# -- the server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(echo_model_dir: Path) -> Iterator[Server]:
    with serve_in_thread(echo_model_dir, "fuzz-responses-server", server=ServerConfig(max_body_bytes=MAX_BODY),
                         grammar=False, max_batch=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with client_of(server) as c:
        yield c


@pytest.fixture(autouse=True)
def _normal_after_each_test(client: httpx.Client) -> Iterator[None]:
    yield
    assert_served(post(client, {"input": "still serving normally"}), "still serving normally")


# -- checks ----------------------------------------------------------------------


def post(client: httpx.Client, obj: Any) -> httpx.Response:
    return post_raw(client, encode(obj))


def post_raw(client: httpx.Client, raw: bytes) -> httpx.Response:
    return post_bytes(client, RESPONSES, raw)


def choice_texts(r: httpx.Response) -> dict[int, str]:
    """The text of each choice of a 200 (``choice_index``, 0 without): the Response
    object's, or a stream's deltas (which must end it, with dense output indices)."""
    texts: dict[int, str] = {0: ""}
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        added = [e for e in events if e["type"] == "response.output_item.added"]
        assert [e["output_index"] for e in added] == list(range(len(added)))
        owner = {e["output_index"]: e["item"].get("choice_index", 0) for e in added}
        for e in events:
            if e["type"] == "response.output_text.delta":
                i = owner[e["output_index"]]
                texts[i] = texts.get(i, "") + e["delta"]
        return texts
    body = r.json()
    assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
    for item in body["output"]:
        if item["type"] == "message":
            i = item.get("choice_index", 0)
            texts[i] = texts.get(i, "") + "".join(part["text"] for part in item["content"])
    return texts


def output_text(r: httpx.Response) -> str:
    """Choice 0's text of a 200; every other choice (``n``) echoes the same."""
    texts = choice_texts(r)
    assert sorted(texts) == list(range(len(texts))), texts
    assert set(texts.values()) == {texts[0]}, texts
    return texts[0]


def assert_served(r: httpx.Response, text: str | None, *, prefix: bool = False) -> None:
    assert r.status_code == 200, (r.status_code, r.text[:500])
    got = output_text(r)
    if text is not None:
        assert text.startswith(got) if prefix else got == text, (got, text)


def assert_ok_or_names(r: httpx.Response, *params: str) -> None:
    """A 200, or a 400 in the envelope naming one of ``params``."""
    if r.status_code == 200:
        output_text(r)
        return
    err = assert_envelope(r)
    assert err["param"] and err["param"].startswith(params), err


# -- strategies ------------------------------------------------------------------

text = st.text(st.characters(exclude_categories=["Cs"]), max_size=20)
safe_text = st.text(alphabet="abcdefghij klmnop", min_size=1, max_size=20).map(str.strip).filter(bool)
json_scalar, json_value = json_values(int_bound=10**30, text=text, keys=text, size=4, max_leaves=12)
not_object = json_value.filter(lambda v: not isinstance(v, dict))
not_string = json_value.filter(lambda v: not isinstance(v, str))


@fuzz
@given(raw=st.one_of(
    st.binary(min_size=1, max_size=200),
    st.builds(lambda cut: json.dumps({"input": "truncated"}).encode()[:cut], st.integers(1, 20)),
    st.sampled_from([b"{", b"{]", b'{"input": [}', b"NaN", b'{"input": Infinity}', b"\x00",
                     b'{"input": "x",}', b'{"input" "x"}', b"[" * 5000 + b"]" * 5000,
                     b'{"input": "x", "max_output_tokens": 1e400}',
                     b'{"input": "\\ud800"}']),
))
def test_invalid_json_bodies(client: httpx.Client, raw: bytes) -> None:
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=lambda c: 1 / 0)
    except (ValueError, ZeroDivisionError, RecursionError):
        assert_envelope(post_raw(client, raw))
        return
    assert_ok_or_names(post_raw(client, raw), "body", "input", "max_output_tokens")
    assert isinstance(value, dict | list | str | int | float | bool | None)


@fuzz
@given(value=not_object)
def test_top_level_not_an_object(client: httpx.Client, value: Any) -> None:
    assert assert_envelope(post(client, value))["param"] == "body"


# -- input items: a self-consistent good conversation, one bad item or none --------------

good_item = st.one_of(
    safe_text.map(lambda t: [{"role": "user", "content": t}]),
    safe_text.map(lambda t: [{"type": "message", "role": "developer",
                              "content": [{"type": "input_text", "text": t}]}]),
    safe_text.map(lambda t: [{"role": "assistant", "content": [{"type": "output_text", "text": t}]}]),
    safe_text.map(lambda t: [{"type": "reasoning", "summary": [{"type": "summary_text", "text": t}]},
                             {"role": "assistant", "content": t}]),
    st.builds(lambda cid, out: [
        {"type": "function_call", "call_id": cid, "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": cid, "output": out}],
        st.text(alphabet="abc123_", min_size=1, max_size=8), safe_text),
)
bad_item = st.one_of(
    not_object,
    st.fixed_dictionaries({"role": json_value.filter(
        lambda r: r not in ("user", "system", "developer", "assistant")), "content": safe_text}),
    st.fixed_dictionaries({"role": st.just("user")}),
    st.fixed_dictionaries({"role": st.just("user"),
                           "content": json_value.filter(lambda c: not isinstance(c, str | list))}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(not_object, min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(st.fixed_dictionaries(
        {"type": text.filter(lambda t: t not in ("input_text", "output_text", "text")), "text": safe_text}),
        min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(st.fixed_dictionaries(
        {"type": st.just("input_text"), "text": not_string}), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": not_string, "name": st.just("f"),
                           "arguments": st.just("{}")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("c"),
                           "name": st.just("f"), "arguments": not_string}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("never_called"),
                           "output": safe_text}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("c"),
                           "output": json_value.filter(lambda o: not isinstance(o, str | list))}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": json_value.filter(
        lambda s: not isinstance(s, list) and s is not None)}),
    st.fixed_dictionaries({"type": st.sampled_from(["item_reference", "web_search_call", "computer_call",
                                                    "mcp_call", "local_shell_call"]), "id": safe_text}),
    st.fixed_dictionaries({"type": text.filter(lambda t: t not in (
        "message", "function_call", "function_call_output", "reasoning")), "x": json_value}),
    st.fixed_dictionaries({"type": json_value.filter(lambda t: not isinstance(t, str) and t is not None),
                           "role": st.just("user"), "content": st.just("x")}),
    st.fixed_dictionaries({"role": st.one_of(st.lists(text, max_size=2), st.dictionaries(text, text)),
                           "content": st.just("x")}),
)


@fuzz
@given(data=st.data(), stream=st.booleans())
def test_input_items(client: httpx.Client, data: st.DataObject, stream: bool) -> None:
    groups = data.draw(st.lists(good_item, max_size=4))
    items = [item for group in groups for item in group]
    kind = data.draw(st.sampled_from(["valid", "bad_item", "not_a_list", "empty"]))
    body: dict[str, Any] = {"stream": stream, "max_output_tokens": 64}
    if kind == "valid":
        body["input"] = [*items, {"role": "user", "content": "fuzzed input"}]
        assert_served(post(client, body), "fuzzed input")
        return
    if kind == "bad_item":
        items.insert(data.draw(st.integers(0, len(items))), data.draw(bad_item))
        body["input"] = items
    elif kind == "not_a_list":
        body["input"] = data.draw(json_value.filter(lambda v: not isinstance(v, str | list)))
    else:
        body["input"] = []
    err = assert_envelope(post(client, body))
    assert err["param"] and err["param"].startswith("input"), err


# -- scalar fields with an oracle: True valid, False invalid -------------------------------


def _is(kind: type) -> Any:
    return lambda v: isinstance(v, kind)


def _metadata(v: Any) -> bool:
    return isinstance(v, dict) and len(v) <= 16 and all(
        isinstance(k, str) and len(k) <= 64 and isinstance(x, str) and len(x) <= 512 for k, x in v.items())


FIELDS: dict[str, Any] = {
    "temperature": num_in(0, 2), "top_p": num_in(0, 1),
    "max_output_tokens": int_in(1, 2**31 - 1), "max_tool_calls": int_in(1, 2**31 - 1),
    "top_logprobs": int_in(0, 20),
    "stream": _is(bool), "store": _is(bool), "parallel_tool_calls": _is(bool),
    "background": lambda v: v is False,  # true is valid but unsupported: 400 too
    "instructions": _is(str), "model": _is(str), "user": _is(str), "service_tier": _is(str),
    "prompt_cache_key": _is(str), "safety_identifier": _is(str),
    "truncation": lambda v: v in ("auto", "disabled"),
    "include": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "metadata": _metadata,
    "previous_response_id": lambda v: False,  # no response is stored under a fuzzed id: 404
    "n": int_in(1, 16),  # afm's extension: n choices, each its own items (choice_index)
}
SAMPLING = {"temperature", "top_p"}

field_value = st.one_of(
    json_value,
    st.integers(-(2**40), 2**40),
    st.sampled_from([0, 1, -1, 2, 2.0, 1.5, 20, 21, 2**31 - 1, 2**31, 1e308, 0.01, True, False, "", "1",
                     None, [], {}]),
)
# the edges of each field, drawn three times out of four
EDGES: dict[str, Any] = {
    "metadata": st.one_of(
        st.sampled_from([{"k": "v"}, {str(i): "v" for i in range(16)}, {str(i): "v" for i in range(17)},
                         {"k" * 64: "v" * 512}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}]),
        st.sampled_from([{str(i): "v" for i in range(n)} for n in (17, 18, 30)]),
        st.dictionaries(text, st.one_of(text, json_value), max_size=18)),
    "include": st.one_of(st.lists(st.one_of(text, json_value), max_size=3), st.sampled_from(
        [["message.output_text.logprobs"], ["reasoning.encrypted_content"], [1], "x"])),
    "truncation": st.sampled_from(["auto", "disabled", "none", "AUTO", 1]),
    "background": st.sampled_from([True, False, 0, "false"]),
    "top_logprobs": st.sampled_from([0, 1, 20, 21, -1, 2.0, 2.5]),
    "max_output_tokens": st.sampled_from([1, 2, 0, -1, 2.0, 2.5, CONTEXT - 1, CONTEXT, 2**31 - 1, 2**31]),
    "max_tool_calls": st.sampled_from([1, 0, 2.0, 2.5, 2**31]),
    "temperature": st.sampled_from([0, 0.0, 2, 2.0001, -0.1]),
    "top_p": st.sampled_from([0, 1, 1.0001, -0.1]),
    "n": st.sampled_from([1, 1.0, 2, 0, 16, 17, -1, True, "1"]),
}


@pytest.mark.parametrize("key", sorted(FIELDS))
@settings(fuzz, max_examples=40)
@given(data=st.data(), stream=st.booleans())
def test_field_types_and_ranges(client: httpx.Client, key: str, data: st.DataObject, stream: bool) -> None:
    edges = EDGES.get(key)
    value = data.draw(st.one_of(field_value, edges, edges, edges) if edges is not None else field_value)
    body: dict[str, Any] = {"input": "fuzzed field", key: value}
    if key != "max_output_tokens":
        body["max_output_tokens"] = 64  # a sampler setting must not make the echo run on
    if key != "stream":
        body["stream"] = stream
    r = post(client, body)
    if value is None:
        assert_served(r, None if key in SAMPLING else "fuzzed field")
        return
    if key == "previous_response_id" and isinstance(value, str):
        err = assert_envelope(r, (404,))
        assert err["code"] == "previous_response_not_found" and err["param"] == key
        return
    valid = FIELDS[key](value)
    if key == "max_output_tokens" and valid and value >= CONTEXT - 64:
        if value >= CONTEXT:
            assert assert_envelope(r)["code"] == "context_length_exceeded"
        else:
            assert r.status_code in (200, 400)
        return
    if not valid:
        err = assert_envelope(r)
        assert err["param"] == key, err
        return
    assert_served(r, None if key in SAMPLING else "fuzzed field", prefix=key == "max_output_tokens")
    is_stream = value if key == "stream" else stream
    assert is_stream == r.headers["content-type"].startswith("text/event-stream")
    if key == "n":  # n choices, each the echo
        assert choice_texts(r) == dict.fromkeys(range(int(value)), "fuzzed field")


@fuzz
@given(extra=st.dictionaries(text.filter(lambda k: k not in FIELDS and k not in (
    "input", "tools", "tool_choice", "text", "reasoning", "stream_options", "conversation", "prompt",
    "context_management")), json_value, min_size=1, max_size=5))
def test_unknown_fields_are_ignored(client: httpx.Client, extra: dict[str, Any]) -> None:
    assert_served(post(client, {**extra, "input": "extra fields", "max_output_tokens": 64}), "extra fields")


# -- structured fields: a 200 or a 400 naming them ---------------------------------------

GOOD_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}
tool_entry = st.one_of(
    not_object,
    st.just(GOOD_TOOL),
    st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "mcp", "custom",
                                                    "code_interpreter", "function"]),
                           "name": st.one_of(safe_text, not_string), "parameters": json_value,
                           "strict": json_value, "description": json_value}),
    st.dictionaries(text, json_value, max_size=4),
    st.fixed_dictionaries({"type": st.just("namespace"), "name": st.one_of(safe_text, not_string),
                           "tools": st.one_of(json_value, st.lists(st.one_of(
                               st.just(GOOD_TOOL), st.just({"type": "web_search"}), json_value),
                               max_size=3))}),
)
tool_choice = st.one_of(
    json_value,
    st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"},
                     {"type": "function", "name": "g"}, {"type": "web_search_preview"},
                     {"type": "function", "name": "f", "namespace": "n"},
                     {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]},
                     {"type": "allowed_tools", "mode": "always", "tools": []}]),
    st.fixed_dictionaries({"type": st.sampled_from(["function", "allowed_tools"]), "name": json_value,
                           "mode": json_value, "tools": json_value}),
)


@fuzz
@given(tools=st.one_of(json_value, st.lists(tool_entry, max_size=3)), choice=tool_choice,
       use_choice=st.booleans())
def test_tools_and_tool_choice(client: httpx.Client, tools: Any, choice: Any, use_choice: bool) -> None:
    body: dict[str, Any] = {"input": "fuzzed tools", "tools": tools, "max_output_tokens": 64}
    if use_choice:
        body["tool_choice"] = choice
    r = post(client, body)
    assert_ok_or_names(r, "tools", "tool_choice")
    if r.status_code == 200 and (not use_choice or choice in ("auto", "none", None)):
        assert output_text(r) == "fuzzed tools"


text_config = st.one_of(
    json_value,
    st.fixed_dictionaries({"format": st.one_of(json_value, st.fixed_dictionaries({
        "type": st.sampled_from(["text", "json_object", "json_schema", "yaml"]),
        "name": json_value, "schema": st.one_of(json_value, st.just({"type": "object"})),
        "strict": json_value, "description": json_value})),
        "verbosity": st.one_of(json_value, st.sampled_from(["low", "medium", "high"]))}),
)
reasoning_config = st.one_of(
    json_value,
    st.fixed_dictionaries({"effort": st.one_of(json_value, st.sampled_from(
        ["none", "minimal", "low", "medium", "high", "xhigh", "max"])),
        "summary": st.one_of(json_value, st.sampled_from(["auto", "concise", "detailed"]))}),
)


@fuzz
@given(text_cfg=text_config, reasoning=reasoning_config, which=st.sampled_from(["text", "reasoning", "both"]))
def test_text_and_reasoning_configs(client: httpx.Client, text_cfg: Any, reasoning: Any, which: str) -> None:
    body: dict[str, Any] = {"input": "fuzzed config", "max_output_tokens": 64}
    if which in ("text", "both"):
        body["text"] = text_cfg
    if which in ("reasoning", "both"):
        body["reasoning"] = reasoning
    assert_ok_or_names(post(client, body), "text", "reasoning")


@fuzz
@given(depth=st.integers(65, 3000), where=st.sampled_from(["input", "metadata", "tools", "extra"]))
def test_deep_nesting(client: httpx.Client, depth: int, where: str) -> None:
    nested = "[" * depth + "]" * depth
    raws = {
        "input": '{"input": [{"role": "user", "content": %s}]}',
        "metadata": '{"input": "x", "metadata": {"k": %s}}',
        "tools": '{"input": "x", "tools": [{"type": "function", "name": "f", "parameters": %s}]}',
        "extra": '{"input": "x", "anything": %s}',
    }
    err = assert_envelope(post_raw(client, (raws[where] % nested).encode()))
    assert err["param"] == "body"


# -- the other routes -----------------------------------------------------------------

ids = st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(["resp_", "resp_x", "..", "%00", " "]))


@fuzz
@given(rid=ids, route=st.sampled_from([("GET", ""), ("DELETE", ""), ("POST", "/cancel"),
                                       ("GET", "/input_items"), ("PUT", ""), ("POST", "")]),
       query=st.dictionaries(st.sampled_from(["limit", "order", "after", "stream", "include"]),
                             st.text(max_size=10), max_size=3))
def test_other_routes_with_fuzzed_ids(client: httpx.Client, rid: str, route: tuple[str, str],
                                      query: dict[str, str]) -> None:
    method, tail = route
    path = f"{RESPONSES}/{quote(rid, safe='')}{tail}"
    r = client.request(method, path, params=query)
    if "/" in rid and r.status_code == 308:
        return  # a decoded "%2F" makes "//": werkzeug merges the slashes with a redirect
    err = assert_envelope(r, (400, 404, 405))
    if r.status_code == 404 and method != "PUT" and "/" not in rid and rid not in (".", ".."):
        assert err["param"] in ("response_id", None), err
