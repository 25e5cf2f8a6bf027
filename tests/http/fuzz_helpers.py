"""What the Hypothesis fuzz tests of the HTTP routes share (``test_fuzz*.py``).

One real server (hypercorn on 127.0.0.1, echo model) runs in a background
thread with its own ``trio.run`` for a whole test module
(:func:`serve_in_thread`); the tests are synchronous and talk to it with one
``httpx.Client``.  Also here: the Hypothesis settings, the JSON value
strategies, the small field oracles, the body encoding and the OpenAI error
envelope check.
"""

from __future__ import annotations

import json
import math
import string
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from afm_http.testing import running_server

MAX_BODY = 64 * 1024
CONTEXT = 32768  # the echo model's


def fuzz_settings(max_examples: int) -> settings:
    """The settings every fuzz test starts from (``@settings(fuzz, max_examples=...)`` narrows)."""
    return settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# -- the server ------------------------------------------------------------------


class Server:
    """A running server: its URL and port, the engine, and the Trio thread it runs in."""

    def __init__(self, url: str, engine: Any, token: trio.lowlevel.TrioToken, thread: threading.Thread,
                 extra: dict[str, Any]) -> None:
        self.url, self.engine, self.token, self.thread = url, engine, token, thread
        self.port = int(url.rsplit(":", 1)[1])
        self.extra = extra  # what ``on_start`` returned
        self.final_statistics: Any = None  # the engine's statistics once stopped

    def statistics(self) -> Any:
        return trio.from_thread.run_sync(self.engine.statistics, trio_token=self.token)


@contextmanager
def serve_in_thread(model_dir: Path, name: str, *, on_start: Callable[[Any], dict[str, Any]] | None = None,
                    **config: Any) -> Iterator[Server]:
    """A :func:`running_server` (``config`` goes to it) in a background thread, for a module fixture.

    On leaving, the thread must still be alive and must stop without an error.
    """
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with running_server(model_dir, **config) as (url, engine):
            box.update(url=url, engine=engine, stop=trio.Event(), token=trio.lowlevel.current_trio_token(),
                       extra=on_start(engine) if on_start is not None else {})
            ready.set()
            await box["stop"].wait()
            box["final"] = engine.statistics()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - reported by the fixture
            box["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    assert ready.wait(120) and "error" not in box, box.get("error")
    srv = Server(box["url"], box["engine"], box["token"], thread, box["extra"])
    yield srv
    assert thread.is_alive(), "the server thread died"
    srv.token.run_sync_soon(box["stop"].set)
    thread.join(60)
    assert "error" not in box, box["error"]
    srv.final_statistics = box["final"]


@contextmanager
def client_of(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# -- bodies and checks -------------------------------------------------------------


def encode(obj: Any) -> bytes:
    """A body as the fuzz tests send it: lone surrogates and NaN pass through unchanged."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")


def post_bytes(client: httpx.Client, path: str, raw: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return client.post(path, content=raw, headers={"Content-Type": "application/json", **(headers or {})})


def sse_data(r: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an event stream, in order."""
    return [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]


def assert_openai_envelope(r: httpx.Response, status: int | tuple[int, ...] = 400) -> dict[str, Any]:
    """A 4xx in OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``; returns the error."""
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    assert r.headers["x-request-id"] == r.headers["openai-request-id"]
    return err


def has_surrogate(v: Any) -> bool:
    if isinstance(v, str):
        return any(0xD800 <= ord(ch) <= 0xDFFF for ch in v)
    if isinstance(v, list):
        return any(has_surrogate(x) for x in v)
    if isinstance(v, dict):
        return any(has_surrogate(k) or has_surrogate(x) for k, x in v.items())
    return False


# -- strategies ------------------------------------------------------------------

SAFE = string.ascii_letters + string.digits + " .,!?"


def safe_texts(max_size: int) -> st.SearchStrategy[str]:
    """Short printable text without surrounding spaces."""
    return st.text(alphabet=SAFE, min_size=1, max_size=max_size).filter(lambda s: s.strip() == s and s)


def json_values(*, int_bound: int, text: st.SearchStrategy[str], keys: st.SearchStrategy[str],
                size: int, max_leaves: int) -> tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]:
    """``(json_scalar, json_value)``: any JSON scalar, and any JSON value built of them."""
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-int_bound, int_bound),
                       st.floats(allow_nan=False, allow_infinity=False), text)
    value = st.recursive(scalar, lambda inner: st.one_of(
        st.lists(inner, max_size=size), st.dictionaries(keys, inner, max_size=size)), max_leaves=max_leaves)
    return scalar, value


# -- field oracles: True valid, False invalid ------------------------------------


def num_in(lo: float, hi: float) -> Callable[[Any], bool]:
    """A finite number (not a bool) in ``[lo, hi]``."""
    def ok(v: Any) -> bool:
        return not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) and lo <= v <= hi
    return ok


def int_in(lo: int, hi: int) -> Callable[[Any], bool]:
    """A whole number (an integral float too, not a bool) in ``[lo, hi]``."""
    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        if isinstance(v, float) and not v.is_integer():
            return False
        return lo <= v <= hi
    return ok


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)
