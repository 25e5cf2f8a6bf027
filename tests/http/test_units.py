"""Pure parts of afm_http: body decoding, JSON bodies, request ids, metrics text,
error mapping, the start-up log's BLAS line."""

from __future__ import annotations

import json
import re
import types
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import afm_http
from afm_core import (
    DuplicateRequestError,
    EngineBusyError,
    EngineStatistics,
    RequestError,
    SSEEncoder,
    StreamFailure,
)
from afm_core._mlx.blas import BlasInfo
from afm_http._body import parse_json
from afm_http._errors import from_exception
from afm_http._ids import MAX_ID_LENGTH, client_request_id, mint_request_id, valid_request_id
from afm_http._json import dumps
from afm_http._metrics import escape_label, render
from afm_http._middleware import _authorized
from afm_http._request import profile_mode
from afm_http._serve_cli import describe_blas


def test_exported_names() -> None:
    public = {n for n in dir(afm_http) if not n.startswith("_")
              and not isinstance(getattr(afm_http, n), types.ModuleType)} - {"annotations"}
    assert public == set(afm_http.__all__) == {
        "ServerConfig", "create_app", "hypercorn_config", "serve_engine"}


@pytest.mark.parametrize("raw", [
    b"", b"{", b"\xff", b"NaN", b'{"a": Infinity}', b'{"a": -Infinity}', b'{"a": 1e400}',
    b'{"a": ' + b"9" * 5000 + b"}", b'"\\ud800"', b'{"\\udfff": 1}', b'["ok", "\\ud83d"]',
    b"[" * 100 + b"]" * 100, b"[" * 100000,
])
def test_parse_json_rejects_with_request_error(raw: bytes) -> None:
    with pytest.raises(RequestError) as info:
        parse_json(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    assert info.value.param == "body" and info.value.message


def test_parse_json_accepts_plain_json() -> None:
    assert parse_json(b'{"a": [1, 2.5, "\\ud83d\\ude00", null, true]}') == \
        {"a": [1, 2.5, "\U0001f600", None, True]}
    assert parse_json(b"[" * 64 + b"]" * 64, max_depth=64) == json.loads(b"[" * 64 + b"]" * 64)
    with pytest.raises(RequestError):
        parse_json(b"[" * 65 + b"]" * 65, max_depth=64)


@given(st.binary(max_size=64))
def test_parse_json_only_raises_request_error(raw: bytes) -> None:
    try:
        parse_json(raw)
    except RequestError:
        pass


def test_request_ids() -> None:
    assert valid_request_id("stream-8f31") and valid_request_id("a" * MAX_ID_LENGTH)
    for bad in ("", "a" * (MAX_ID_LENGTH + 1), "bad id", "x\r\nSet-Cookie: a=b", "-lead", "é",
                "a/b", 'q"', "a\tb", "a\x00"):
        assert not valid_request_id(bad), bad
    minted = mint_request_id()
    assert valid_request_id(minted) and minted != mint_request_id()
    assert client_request_id("client-1") == ("client-1", True)
    rid, ok = client_request_id("bad\nid")
    assert not ok and valid_request_id(rid)
    for blank in (None, "", "  "):
        rid, ok = client_request_id(blank)
        assert ok and rid.startswith("req_")


def test_authorization() -> None:
    assert _authorized("Bearer s3cret", "s3cret") and _authorized("bearer  s3cret ", "s3cret")
    for header in (None, "", "s3cret", "Basic s3cret", "Bearer s3cre", "Bearer s3cretX",
                   "Bearer \udcff"):
        assert not _authorized(header, "s3cret"), header


def test_profile_header() -> None:
    assert [profile_mode(v) for v in (None, "", "false", "0", "true", "TRUE", "1", "extended",
                                      " Extended ", "basic", "off", "none")] == \
        [None, None, None, None, "basic", "basic", "basic", "extended", "extended", "basic", None, None]
    for bad in ("yes please", "2", "extended,true"):
        with pytest.raises(RequestError) as info:
            profile_mode(bad)
        assert info.value.status == 400 and info.value.param == "X-AFM-Profile"
        assert info.value.code == "invalid_header"


async def test_error_mapping() -> None:
    busy = from_exception(EngineBusyError(retry_after=2.4))
    assert busy.status_code == 503 and busy.headers["Retry-After"] == "2"
    assert from_exception(EngineBusyError(retry_after=0.1)).headers["Retry-After"] == "1"
    dup = from_exception(DuplicateRequestError("taken"))
    assert dup.status_code == 409
    assert json.loads(await dup.get_data()) == {"error": {
        "message": "taken", "type": "invalid_request_error", "param": None,
        "code": "duplicate_request_id"}}
    big = from_exception(RequestError("too big", status=413, code="request_too_large"))
    assert big.status_code == 413 and big.headers["Connection"] == "close"


def _stats(**kw: Any) -> EngineStatistics:
    """A statistics snapshot (the real type: a new field cannot be missed here)."""
    values: dict[str, Any] = dict(
        running=2, waiting=1, requests_total=10, requests_active=3, prompt_tokens=100,
        cached_tokens=30, generation_tokens=50, prefix_cache_hits=4, prefix_cache_lookups=9,
        prefix_cache_bytes=4096, steps=77, ttft_seconds_sum=0.25, ttft_count=10,
        finished={"stop": 7, "cancelled": 2})
    return EngineStatistics(**{**values, **kw})


def test_metrics_text() -> None:
    text = render([(_stats(), 'we"ird\\name\n'), (_stats(running=0), "emb")], {200: 5, 404: 1})
    lines = text.splitlines()
    label = 'model="we\\"ird\\\\name\\n"'
    assert f"afm_requests_running{{{label}}} 2" in lines
    assert 'afm_requests_running{model="emb"} 0' in lines  # one line per engine, one family
    assert f"afm_prefix_cache_hits_total{{{label}}} 4" in lines
    assert f"afm_time_to_first_token_seconds_count{{{label}}} 10" in lines
    assert f'afm_requests_finished_total{{{label},reason="cancelled"}} 2' in lines
    assert 'afm_http_responses_total{status="404"} 1' in lines
    samples = [ln for ln in lines if not ln.startswith("#")]
    assert all(len(ln.rsplit(" ", 1)) == 2 for ln in samples)
    types_ = [ln.split()[2] for ln in lines if ln.startswith("# TYPE")]
    assert len(types_) == len(set(types_))  # one TYPE line per metric family
    assert escape_label("plain") == "plain"


_TEXT = st.text(st.characters(exclude_categories=()) | st.integers(0xD800, 0xDFFF).map(chr))  # lone surrogates too
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12)


@given(_JSON)
def test_dumps_is_compact_utf8_json_with_escaped_surrogates(obj: object) -> None:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    expected = re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m[0]):04x}", text).encode("utf-8")
    assert dumps(obj) == expected


@given(_TEXT)
def test_dumps_matches_the_sse_encoders_bytes(text: str) -> None:
    """The same bytes as afm_core's encoder writes (its error chunk is built with its dumps)."""
    frame = SSEEncoder("chatcmpl-1", 1, "m").encode(StreamFailure(text, code="internal_error"))
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    payload = frame[len(b"data: "):-2]
    chunk = json.loads(payload)  # lossy: it joins an escaped surrogate pair into one character
    chunk["error"]["message"] = text
    assert dumps(chunk) == payload


@pytest.mark.parametrize("info", [
    BlasInfo("openblas", "OpenBLAS 0.3.34 DYNAMIC_ARCH", 2, verified=True),
    BlasInfo("openblas"),
    BlasInfo("reference", reason="AFM_BLAS=reference"),
    BlasInfo("reference"),
    BlasInfo("accelerate", verified=None),
])
def test_startup_blas_line_from_runtime_info(info: BlasInfo) -> None:
    """``afm serve`` logs the BLAS from ``runtime_info().blas`` (a dict) as ``BlasInfo.describe()`` did."""
    assert describe_blas(info.as_dict()) == info.describe()


def test_speculation_flags_reach_the_engine_config() -> None:
    import argparse

    from afm_http._serve_cli import _engine_config, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = _engine_config(parser.parse_args([]))
    assert (default.prompt_lookup, default.draft_model, default.spec_max_batch) == (None, None, 1)  # lookup: auto
    assert _engine_config(parser.parse_args(["--prompt-lookup", "auto"])).prompt_lookup is None
    assert _engine_config(parser.parse_args(["--prompt-lookup", "0"])).prompt_lookup == 0
    config = _engine_config(parser.parse_args(["--prompt-lookup", "3", "--draft-model", "d", "--draft-tokens", "2",
                                               "--spec-max-batch", "2"]))
    assert (config.prompt_lookup, config.draft_model, config.draft_tokens, config.spec_max_batch) == (3, "d", 2, 2)


def test_json_mode_flag_reaches_the_engine_config() -> None:
    import argparse

    from afm_http._serve_cli import _engine_config, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert _engine_config(parser.parse_args([])).enforce_json_modes
    assert not _engine_config(parser.parse_args(["--no-enforce-json-modes"])).enforce_json_modes


def test_keep_volatile_lines_flag_reaches_the_engine_config() -> None:
    import argparse

    from afm_http._serve_cli import _engine_config, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert not _engine_config(parser.parse_args([])).keep_volatile_lines
    assert _engine_config(parser.parse_args(["--keep-volatile-lines"])).keep_volatile_lines


def test_serve_flags_default_to_the_config_defaults() -> None:
    """Each setting is declared once: a flag named after an ``EngineConfig`` or
    ``ServerConfig`` field takes that field's default, and ``afm serve`` with no
    flags builds the default ``EngineConfig``."""
    import argparse
    import dataclasses

    from afm_core import EngineConfig
    from afm_http._serve_cli import _engine_config, add_arguments
    from afm_http._state import ServerConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = vars(parser.parse_args([]))
    checked = 0
    for config in (EngineConfig(), ServerConfig()):
        for f in dataclasses.fields(config):
            if f.name in args:
                assert args[f.name] == getattr(config, f.name), f.name
                checked += 1
    assert checked >= 25  # (the engine's and the server's tuning flags)
    assert _engine_config(parser.parse_args([])) == EngineConfig()
