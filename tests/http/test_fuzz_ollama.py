"""Fuzzed Ollama bodies (``/api/chat``, ``/api/generate``, ``/api/embed``) against ONE
real server (hypercorn on 127.0.0.1, echo model), as the other ``test_fuzz*.py``.

The property: whatever the body, the answer is a 200 the ``ollama`` client's
typed models accept, or a 4xx in Ollama's envelope (``{"error": "..."}``,
nothing else); never a 500.  A streamed answer is NDJSON lines, each a JSON
object, the last one ``done`` or an ``error``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.http.fuzz_helpers import (
    Server,
    client_of,
    encode,
    fuzz_settings,
    json_values,
    post_bytes,
    safe_texts,
    serve_in_thread,
)

fuzz = fuzz_settings(150)


@pytest.fixture(scope="module")
def server(echo_model_dir: Path) -> Iterator[Server]:
    with serve_in_thread(echo_model_dir, "fuzz-ollama-server") as srv:
        yield srv


scalar, junk = json_values(int_bound=50, text=st.text(max_size=6), keys=st.text(max_size=6), size=3,
                           max_leaves=8)
OPTION_KEYS = ["temperature", "top_p", "top_k", "min_p", "seed", "num_predict", "stop", "repeat_penalty",
               "presence_penalty", "frequency_penalty", "num_ctx", "use_mmap", "typical_p", "nonsense"]
options = st.one_of(junk, st.dictionaries(st.sampled_from(OPTION_KEYS), scalar | st.lists(scalar, max_size=2),
                                          max_size=4))
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "USER", "system", "assistant", "tool", "wizard"]) | junk},
    optional={"content": safe_texts(12) | junk, "thinking": safe_texts(6) | junk,
              "tool_calls": junk, "images": junk, "tool_name": junk})
messages = st.one_of(junk, st.lists(message, max_size=3))
schema = st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
fields = {"options": options, "stream": st.booleans() | junk,
          "format": st.sampled_from(["json", ""]) | schema | junk, "think": st.booleans() | junk,
          "keep_alive": st.sampled_from(["5m", 30, -1]) | junk, "logprobs": st.booleans() | junk,
          "top_logprobs": st.integers(-2, 22) | junk}
chat_bodies = st.fixed_dictionaries({"model": st.just("m") | junk, "messages": messages},
                                    optional={**fields, "tools": junk})
generate_bodies = st.fixed_dictionaries(
    {"model": st.just("m") | junk, "prompt": safe_texts(12) | junk},
    optional={**fields, "system": safe_texts(6) | junk, "raw": st.booleans() | junk, "suffix": junk,
              "template": junk, "context": junk, "images": junk})


def limited(body: dict[str, Any]) -> dict[str, Any]:
    """Keep the answers short: at most 8 tokens (when ``options`` is an object)."""
    if isinstance(body.get("options"), dict):
        body["options"]["num_predict"] = 8
    return body


def check(r: httpx.Response, response_type: type) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 200:
        assert 400 <= r.status_code < 500
        body = r.json()
        assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
        return
    if r.headers["content-type"].startswith("application/x-ndjson"):
        lines = [json.loads(line) for line in r.text.splitlines()]
        assert lines and (lines[-1].get("done") is True or set(lines[-1]) == {"error"})
        for line in lines:
            if "error" not in line:
                response_type(**line)
        return
    response_type(**r.json())


@fuzz
@given(body=chat_bodies)
def test_fuzzed_chat_bodies(server: Server, body: dict[str, Any]) -> None:
    with client_of(server) as c:
        check(post_bytes(c, "/api/chat", encode(limited(body))), ollama.ChatResponse)


@fuzz
@given(body=generate_bodies)
def test_fuzzed_generate_bodies(server: Server, body: dict[str, Any]) -> None:
    with client_of(server) as c:
        check(post_bytes(c, "/api/generate", encode(limited(body))), ollama.GenerateResponse)


@fuzz
@given(body=st.fixed_dictionaries({"model": st.just("m") | junk},
                                  optional={"input": junk, "truncate": junk, "dimensions": junk}))
def test_fuzzed_embed_bodies(server: Server, body: dict[str, Any]) -> None:
    with client_of(server) as c:
        r = post_bytes(c, "/api/embed", encode(body))
    # the echo model has no hidden states: a body that gets past validation is a 400 too
    # (or a 200 with no input); never a 500
    check(r, ollama.EmbedResponse)
