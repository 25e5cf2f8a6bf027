"""Fuzzed completions bodies against ONE real server (hypercorn on 127.0.0.1, echo model).

Like ``test_fuzz.py``: the server runs in a background thread for the whole
module, Hypothesis tests are synchronous and talk to it with one
``httpx.Client``, and a small oracle written here (independent of
``afm_core``'s validation) says whether each body is valid.  Invalid ones
must get a 4xx with the OpenAI envelope, valid ones a 200 whose echoed text is
right; never a 500, and after each category a normal completion is served.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.http.fuzz_helpers import (
    CONTEXT,
    Server,
    assert_openai_envelope,
    client_of,
    encode,
    fuzz_settings,
    int_in,
    is_bool,
    json_values,
    num_in,
    post_bytes,
    safe_texts,
    serve_in_thread,
    sse_data,
)

COMPLETIONS = "/v1/completions"
CHAT_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
MAX_BATCH, MAX_WAITING = 4, 8  # at most 12 choices per request
EXAMPLES = 150

STATUSES: dict[str, Counter[int]] = {}

fuzz = fuzz_settings(EXAMPLES)


@pytest.fixture(scope="module")
def server(echo_model_dir: Path) -> Iterator[Server]:
    with serve_in_thread(echo_model_dir, "fuzz-completions-server",
                         on_start=lambda eng: {"vocab": min(eng.info.vocab_size, len(eng._tokenizer))},
                         grammar=False, max_batch=MAX_BATCH, max_waiting=MAX_WAITING) as srv:
        yield srv
    print("\nfuzz_completions statuses:",
          json.dumps({k: {str(s): n for s, n in sorted(v.items())} for k, v in sorted(STATUSES.items())}))


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with client_of(server) as c:
        yield c


@pytest.fixture(autouse=True)
def _normal_after_each_category(server: Server, client: httpx.Client) -> Iterator[None]:
    yield
    r = client.post(COMPLETIONS, json={"prompt": CHAT_PROMPT.format("still serving"), "max_tokens": 20})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "still serving"
    stats = server.statistics()
    assert stats.requests_active == 0 and stats.running == 0


# -- checks ----------------------------------------------------------------------------


def post(client: httpx.Client, category: str, obj: Any = None, raw: bytes | None = None) -> httpx.Response:
    r = post_bytes(client, COMPLETIONS, encode(obj) if raw is None else raw)
    STATUSES.setdefault(category, Counter())[r.status_code] += 1
    assert r.status_code != 500 and r.status_code < 500, (r.status_code, r.text[:500])
    return r


def assert_envelope(r: httpx.Response) -> dict[str, Any]:
    """Any 4xx, in OpenAI's envelope."""
    return assert_openai_envelope(r, tuple(range(400, 500)))


def texts_of(r: httpx.Response) -> dict[int, str]:
    """Each choice's text, from a streamed or a whole response; checks the framing."""
    assert r.status_code == 200, (r.status_code, r.text[:500])
    if not r.headers["content-type"].startswith("text/event-stream"):
        data = r.json()
        assert data["object"] == "text_completion" and data["usage"]["total_tokens"] >= 0
        return {c["index"]: c["text"] for c in data["choices"]}
    lines = sse_data(r)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(d) for d in lines[:-1]]
    assert not any("error" in c for c in chunks), chunks
    out: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            out[ch["index"]] = out.get(ch["index"], "") + ch["text"]
    return out


# -- strategies --------------------------------------------------------------------------

safe_text = safe_texts(30)
json_scalar, json_value = json_values(int_bound=10**20, text=st.text(max_size=12), keys=st.text(max_size=8),
                                      size=4, max_leaves=10)
token_id = st.one_of(st.integers(0, 1100), st.integers(-5, 2**32), st.booleans(), st.floats(0, 10),
                     st.text(max_size=3))
prompt_value = st.one_of(
    safe_text.map(CHAT_PROMPT.format),
    st.lists(safe_text.map(CHAT_PROMPT.format), min_size=1, max_size=5),
    st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=5), min_size=1, max_size=5),
    st.just(""),
    st.text(max_size=20),
    json_scalar,
    st.lists(token_id, max_size=6),
    st.lists(st.integers(0, 1100), min_size=1, max_size=6),
    st.lists(st.one_of(safe_text.map(CHAT_PROMPT.format), st.just(""), json_scalar,
                       st.lists(token_id, max_size=4)), max_size=14),
    json_value,
)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ids_ok(ids: list[Any], vocab: int) -> bool | None:
    """True valid, False a validation error, None out of the vocabulary (a 400 too)."""
    if not ids or not all(_is_int(t) and 0 <= t <= 2**31 - 1 for t in ids):
        return False
    return all(t < vocab for t in ids) or None


def prompts_of(value: Any, vocab: int) -> list[Any] | None:
    """The prompts of a valid ``prompt`` value, or None when it is invalid."""
    if isinstance(value, str):
        return [value] if value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value) else None
    if not isinstance(value, list) or not value:
        return None
    if _is_int(value[0]) or isinstance(value[0], bool):
        return [value] if _ids_ok(value, vocab) else None
    out = []
    for p in value:
        if isinstance(p, str):
            if not p or any(0xD800 <= ord(c) <= 0xDFFF for c in p):
                return None
        elif not (isinstance(p, list) and _ids_ok(p, vocab)):
            return None
        out.append(p)
    return out


def expected_text(prompt: Any) -> str | None:
    """What the echo model answers to a chat-shaped text prompt (None: anything)."""
    if isinstance(prompt, str) and prompt.startswith("<|im_start|>user\n") and prompt.endswith("assistant\n"):
        return prompt.removeprefix("<|im_start|>user\n").split("<|im_end|>")[0]
    return None


@fuzz
@given(value=prompt_value, stream=st.booleans())
def test_prompt_forms(server: Server, client: httpx.Client, value: Any, stream: bool) -> None:
    r = post(client, "prompt", {"prompt": value, "max_tokens": 40, "stream": stream})
    prompts = prompts_of(value, server.extra["vocab"])
    if prompts is None or len(prompts) > MAX_BATCH + MAX_WAITING:
        err = assert_envelope(r)
        assert err["param"] is not None and (err["param"].startswith("prompt") or err["param"] == "body")
        return
    got = texts_of(r)
    assert sorted(got) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        want = expected_text(p)
        if want is not None:
            assert got[i] == want


FIELDS: dict[str, Any] = {
    "temperature": num_in(0, 2), "top_p": num_in(0, 1), "min_p": num_in(0, 1),
    "presence_penalty": num_in(-2, 2), "frequency_penalty": num_in(-2, 2), "repetition_penalty": num_in(0.01, 10),
    "max_tokens": int_in(0, 2**31 - 1), "top_k": int_in(-1, 1023), "n": int_in(1, MAX_BATCH + MAX_WAITING),
    "logprobs": lambda v: v is False or (int_in(0, 20)(v) and v is not True),
    "stream": is_bool, "echo": is_bool, "ignore_eos": is_bool, "add_special_tokens": is_bool,
    "seed": lambda v: _is_int(v) and -(2**63) <= v < 2**64,
    "model": lambda v: isinstance(v, str),
    "suffix": lambda v: False,  # a string asks for fill-in-the-middle: the echo model has no FIM tokens
    "best_of": lambda v: v == 1 and not isinstance(v, bool),
    "stream_options": lambda v: isinstance(v, dict) and isinstance(v.get("include_usage", False), bool),
    "stop": lambda v: (isinstance(v, str) and bool(v)) or (
        isinstance(v, list) and len(v) <= 16 and all(isinstance(s, str) and s for s in v)),
}
SAMPLING = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "top_k", "seed", "ignore_eos", "logprobs"}

field_value = st.one_of(
    json_value,
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2, 2.0, 1.5, 5, 12, 13, 20, 21, 1023, 2**31 - 1, 2**31, 2**63, 2**64,
                     1e308, 0.01, 0.009, 10.0, True, False, "1", "", None, "low", [], {},
                     {"include_usage": True}, {"include_usage": 1}, ["a", ""], ["\n"], "stop"]),
)


VALID: dict[str, Any] = {  # values each field accepts, so the valid side gets explored too
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 10), "max_tokens": st.integers(0, 64), "top_k": st.integers(-1, 100),
    "n": st.integers(1, MAX_BATCH + MAX_WAITING), "logprobs": st.integers(0, 20),
    "seed": st.integers(-(2**63), 2**64 - 1), "model": st.text(max_size=12),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(safe_text, st.lists(safe_text, max_size=3)), "best_of": st.just(1),
}


@fuzz
@given(data=st.data(), key=st.sampled_from(sorted(FIELDS)), stream=st.booleans())
def test_field_types_and_ranges(client: httpx.Client, data: st.DataObject, key: str, stream: bool) -> None:
    value = data.draw(st.one_of(field_value, VALID.get(key, st.booleans())))
    if key == "top_k" and int_in(1024, 1_000_000)(value):
        value = 5000.5
    text = "fuzzed field"
    obj: dict[str, Any] = {"prompt": CHAT_PROMPT.format(text), key: value}
    if key != "max_tokens":
        obj["max_tokens"] = 40
    if key != "stream":
        obj["stream"] = stream
    r = post(client, "field_types", obj)
    valid = value is None or FIELDS[key](value)
    if key == "max_tokens" and valid and value is not None and value > CONTEXT - 32:
        assert r.status_code in (200, 400)  # the exact room depends on the prompt
        if value >= CONTEXT:
            assert assert_envelope(r)["code"] == "context_length_exceeded"
        return
    if not valid:
        err = assert_envelope(r)
        assert err["param"] in (key, "body", "prompt", f"{key}.include_usage"), err
        return
    got = texts_of(r)
    n = int(value) if key == "n" and value is not None else 1
    assert sorted(got) == list(range(n))
    want = text
    if key == "echo" and value:
        want = CHAT_PROMPT.format(text) + text
    for t in got.values():
        if key in SAMPLING:
            continue
        if key == "max_tokens" and value is not None:
            assert want.startswith(t)
        elif key == "stop" and value is not None:
            assert want.startswith(t)
        else:
            assert t == want


KNOWN = set(FIELDS) | {"prompt", "logit_bias", "user", "adapters", "suffix", "stream_options"}


@fuzz
@given(extra=st.dictionaries(st.text(min_size=1, max_size=20).filter(lambda k: k not in KNOWN),
                             json_value, min_size=1, max_size=6), stream=st.booleans())
def test_unknown_extra_fields_are_ignored(client: httpx.Client, extra: dict[str, Any], stream: bool) -> None:
    r = post(client, "extra_fields", {**extra, "prompt": CHAT_PROMPT.format("extra fields"), "stream": stream,
                                      "max_tokens": 40})
    assert texts_of(r) == {0: "extra fields"}


@fuzz
@given(value=st.one_of(json_value, st.lists(st.text(max_size=4), max_size=3)), top=st.booleans())
def test_not_an_object_and_garbage_bodies(client: httpx.Client, value: Any, top: bool) -> None:
    if top:
        if isinstance(value, dict):
            value = [value]
        assert assert_envelope(post(client, "not_object", value))["param"] == "body"
    else:
        raw = json.dumps({"prompt": "x"}).encode()[: len(json.dumps(value)) % 14 + 1]
        assert_envelope(post(client, "garbage", raw=raw))


@fuzz
@given(lb=st.one_of(json_value, st.dictionaries(st.one_of(st.integers(-5, 5000).map(str), st.text(max_size=4)),
                                                st.one_of(st.floats(-200, 200), st.integers(-200, 200),
                                                          json_scalar), max_size=4)))
def test_logit_bias(client: httpx.Client, lb: Any) -> None:
    r = post(client, "logit_bias", {"prompt": CHAT_PROMPT.format("bias"), "max_tokens": 8, "logit_bias": lb})
    if r.status_code == 200:
        texts_of(r)
    else:
        assert assert_envelope(r)["param"] in ("logit_bias", "body")


@fuzz
@given(number=st.sampled_from(["1e400", "-1e400", "9" * 5000, "7" * 400]),
       where=st.sampled_from(["max_tokens", "temperature", "n", "logprobs", "prompt", "prompt_list"]))
def test_huge_numbers(client: httpx.Client, number: str, where: str) -> None:
    if where == "prompt":
        raw = f'{{"prompt": {number}}}'
    elif where == "prompt_list":
        raw = f'{{"prompt": [1, {number}]}}'
    else:
        raw = f'{{"prompt": "x", "{where}": {number}}}'
    assert_envelope(post(client, "huge_numbers", raw=raw.encode()))


def test_suffix_is_refused_on_a_model_without_fim_tokens(client: httpx.Client) -> None:
    for suffix in ("", "    return x", "\n}"):
        err = assert_envelope(post(client, "suffix", {"prompt": "def f(x):", "suffix": suffix}))
        assert err["param"] == "suffix" and err["code"] == "unsupported"
