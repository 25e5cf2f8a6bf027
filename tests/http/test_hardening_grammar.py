"""Issue 31, case 5: a client's schema is never a 500.

A recursive ``$ref`` schema gave 500 ``generation_failed`` "Too many items",
an ``anyOf`` of 2,001 branches a 500 on non-streamed chat and Responses with
the whole grammar (200 KB) in the message, and the outcome changed from one
try to the next (it depended on what the model sampled before the grammar
gave up).  Now the grammar is compiled and probed before generation: what
llguidance cannot enforce is a 400 in the route's own envelope, streamed or
not, with a short message, the same every time; a Hypothesis run over
generated schemas shows no 500.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.http.fuzz_helpers import Server, fuzz_settings, serve_in_thread

WIDE = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"],
                   "additionalProperties": False} for i in range(2001)]}
RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                             "required": ["c"]}}, "$ref": "#/$defs/n"}
HUGE_PATTERN = {"type": "object", "required": ["s"], "properties": {
    "s": {"type": "string", "pattern": "(" + "|".join(f"w{i}x" for i in range(40000)) + ")"}}}


@pytest.fixture(scope="module")
def server(echo_model_dir: Path) -> Iterator[Server]:
    with serve_in_thread(echo_model_dir, "grammar-server", warmup=False) as srv:
        yield srv


def _chat(schema: Any, stream: bool) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "json"}], "max_tokens": 24, "temperature": 0, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}}


def _responses(schema: Any, stream: bool) -> tuple[str, dict[str, Any]]:
    return "/v1/responses", {
        "input": "json", "max_output_tokens": 24, "temperature": 0, "stream": stream, "store": False,
        "text": {"format": {"type": "json_schema", "name": "x", "strict": True, "schema": schema}}}


def _messages(schema: Any, stream: bool) -> tuple[str, dict[str, Any]]:
    return "/v1/messages", {
        "model": "x", "max_tokens": 24, "temperature": 0, "stream": stream,
        "messages": [{"role": "user", "content": "call f"}], "tool_choice": {"type": "any"},
        "tools": [{"name": "f", "input_schema": schema}]}


def _tool_chat(schema: Any, stream: bool) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "call f"}], "max_tokens": 24, "temperature": 0, "stream": stream,
        "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}


ROUTES = (_chat, _responses, _messages, _tool_chat)


def _outcome(c: httpx.Client, route: Any, schema: Any, stream: bool) -> tuple[int, str]:
    path, body = route(schema, stream)
    r = c.post(path, json=body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert len(err["message"]) < 400 and '"anyOf"' not in err["message"] and "%json" not in err["message"]
        return r.status_code, err["type"]
    text = r.text
    assert "server_error" not in text and "generation_failed" not in text, text[:500]
    return 200, "ok"


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.__name__.strip("_"))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_wide_anyof_is_the_clients_400_every_time(server: Server, route: Any, stream: bool) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        got = {_outcome(c, route, WIDE, stream) for _ in range(3)}
    assert got in ({(400, "invalid_request_error")}, {(400, "invalid_request_error")}), got


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.__name__.strip("_"))
def test_a_recursive_schema_gives_the_same_answer_every_time(server: Server, route: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        got = {_outcome(c, route, RECURSIVE, stream) for stream in (False, True) for _ in range(3)}
    assert got == {(200, "ok")}, got


def test_a_huge_pattern_is_refused_at_once(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post(*_chat(HUGE_PATTERN, False)[:1], json=_chat(HUGE_PATTERN, False)[1])
        assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_too_large"
        assert r.json()["error"]["param"] == "response_format"


# -- Hypothesis: generated schemas, valid and not -------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "name", "x-y", "", "k" * 40])
PATTERNS = st.sampled_from(["^[a-z]+$", "(", "[a-", "\\", "a{2,1}", "(a|b)*c", "\\d{3}-\\d{4}", ".*", "x{99999}"])
SCALARS = st.one_of(
    st.just({"type": "string"}), st.builds(lambda p: {"type": "string", "pattern": p}, PATTERNS),
    st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi},
              st.integers(-5, 5), st.integers(-5, 5)),
    st.just({"type": "number"}), st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=4)),
    st.builds(lambda v: {"const": v}, st.one_of(st.integers(), st.text(max_size=5), st.none())),
    st.just({"$ref": "#"}), st.just({"$ref": "#/$defs/missing"}), st.just({"type": 5}),
    st.just({"type": ["string", "null"]}), st.just({}), st.just(True), st.just(False),
    st.just({"type": "string", "format": "date-time"}), st.just({"not": {"type": "string"}}),
    st.builds(lambda n: {"type": "string", "minLength": n, "maxLength": max(n - 1, 0)}, st.integers(0, 3)))


def _schemas() -> st.SearchStrategy[Any]:
    def extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.builds(lambda props, req, extra: {"type": "object", "properties": props,
                                                 "required": [k for k in props if k in req],
                                                 "additionalProperties": extra},
                      st.dictionaries(NAMES, inner, max_size=4), st.sets(NAMES), st.booleans()),
            st.builds(lambda items, lo, hi: {"type": "array", "items": items, "minItems": lo, "maxItems": hi},
                      inner, st.integers(0, 3), st.integers(0, 3)),
            st.builds(lambda alts, kind: {kind: alts}, st.lists(inner, min_size=1, max_size=4),
                      st.sampled_from(["anyOf", "oneOf", "allOf"])),
            st.builds(lambda d, top: {"$defs": {"d": d}, **top}, inner,
                      st.sampled_from([{"$ref": "#/$defs/d"}, {"type": "array", "items": {"$ref": "#/$defs/d"}}])),
            st.builds(lambda props: {"properties": props}, st.lists(inner, max_size=2)))  # (a malformed one)
    return st.recursive(SCALARS, extend, max_leaves=12)


@settings(fuzz_settings(60))
@given(schema=_schemas(), route=st.sampled_from(ROUTES), stream=st.booleans())
def test_generated_schemas_never_give_a_500(server: Server, schema: Any, route: Any, stream: bool) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        status, kind = _outcome(c, route, schema, stream)
    assert status in (200, 400), (status, kind, json.dumps(schema)[:300])


EXTERNAL_REF = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}, "required": ["a"]}


def test_loose_schema_that_cannot_compile_is_downgraded_not_refused(server: Server) -> None:
    """Issue 30: a json_schema without strict is enforced best-effort; what llguidance
    cannot compile runs unconstrained with ``X-Grammar-Constraints: downgraded`` (strict: 400)."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for route in (_chat, _responses):
            path, body = route(EXTERNAL_REF, False)
            r = c.post(path, json=body)
            assert r.status_code == 400, r.text
            fmt = body["response_format"]["json_schema"] if "response_format" in body else body["text"]["format"]
            del fmt["strict"]
            r = c.post(path, json=body)
            assert r.status_code == 200 and r.headers["x-grammar-constraints"] == "downgraded", r.text
            body["stream"] = True
            r = c.post(path, json=body)
            assert r.status_code == 200 and r.headers["x-grammar-constraints"] == "downgraded", r.text
            # a schema that compiles is enforced: nothing downgraded
            fmt["schema"] = {"type": "object"}
            r = c.post(path, json=body)
            assert r.status_code == 200 and "x-grammar-constraints" not in r.headers
