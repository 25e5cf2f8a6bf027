"""Fuzzed embeddings bodies against ONE real server (hypercorn on 127.0.0.1, random model).

Like the other ``test_fuzz*.py``: the server runs in a background thread for
the whole module, and a small oracle written here (independent of
``afm_core``'s validation) says whether each body is valid.  Invalid ones
must get a 400 in OpenAI's envelope, valid ones a 200 with one unit vector
of the right length per input; never a 500.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.http.fuzz_helpers import (
    Server,
    assert_openai_envelope,
    client_of,
    encode,
    fuzz_settings,
    has_surrogate,
    int_in,
    json_values,
    post_bytes,
    serve_in_thread,
)

EMBEDDINGS = "/v1/embeddings"
HIDDEN = 64  # make_random_model's hidden size
fuzz = fuzz_settings(120)


@pytest.fixture(scope="module")
def server(random_model_dir: Path) -> Iterator[Server]:
    with serve_in_thread(random_model_dir, "fuzz-embeddings-server", warmup=False,
                         on_start=lambda eng: {"vocab": min(eng.info.vocab_size, len(eng._tokenizer))}) as srv:
        yield srv


_, junk = json_values(int_bound=2000, text=st.text(max_size=6), keys=st.text(max_size=4), size=3,
                      max_leaves=8)
ids = st.lists(st.integers(-2, 1100), min_size=0, max_size=6)
texts = st.text(max_size=12)
inputs = st.one_of(texts, ids, st.lists(st.one_of(texts, ids), max_size=4), junk)
formats = st.one_of(st.none(), st.sampled_from(["float", "base64", "int8", ""]), junk)
dimensions = st.one_of(st.none(), st.integers(-1, HIDDEN + 2), st.sampled_from([16.0, 2.5, "8", True]))


def valid_ids(v: Any, vocab: int) -> bool:
    return (isinstance(v, list) and bool(v)
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in v))


def input_count(v: Any, vocab: int) -> int | None:
    """How many vectors a valid ``input`` asks for; None when invalid."""
    if isinstance(v, str):
        return 1 if v and not has_surrogate(v) else None
    if not isinstance(v, list) or not v:
        return None
    if all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        return 1 if valid_ids(v, vocab) else None
    for item in v:
        if isinstance(item, str):
            if not item or has_surrogate(item):
                return None
        elif not valid_ids(item, vocab):
            return None
    return len(v)


@fuzz
@given(value=inputs, fmt=formats, dims=dimensions, model=st.one_of(st.none(), st.just("m"), junk))
def test_fuzzed_bodies(server: Server, value: Any, fmt: Any, dims: Any, model: Any) -> None:
    body: dict[str, Any] = {"input": value}
    for key, v in (("encoding_format", fmt), ("dimensions", dims), ("model", model)):
        if v is not None:
            body[key] = v
    n = input_count(value, server.extra["vocab"])
    valid = (n is not None and fmt in (None, "float", "base64")
             and (dims is None or int_in(1, HIDDEN)(dims)) and (model is None or isinstance(model, str)))
    with client_of(server) as c:
        r = post_bytes(c, EMBEDDINGS, encode(body))
    if not valid:
        assert_openai_envelope(r, 400)
        return
    assert r.status_code == 200, r.text[:500]
    data = r.json()
    assert data["object"] == "list" and len(data["data"]) == n
    assert data["model"] == (model if model is not None else data["model"])
    assert data["usage"]["prompt_tokens"] == data["usage"]["total_tokens"] >= n
    size = HIDDEN if dims is None else int(dims)
    for i, item in enumerate(data["data"]):
        assert item["object"] == "embedding" and item["index"] == i
        vec = item["embedding"]
        if fmt == "base64":
            raw = base64.b64decode(vec)
            vec = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert len(vec) == size
        assert math.isclose(math.fsum(x * x for x in vec), 1.0, abs_tol=1e-4)
