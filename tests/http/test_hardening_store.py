"""Issue 31, case 6: the Responses store is bounded in bytes, not only in count.

A stored response keeps what its request echoes (a ``text.format`` schema of
7 MB: 120 of them took RSS to 1.2 GB; the default 1,000 would reach ~7 GB).
Now ``ServerConfig.responses_store_bytes`` (``--responses-store-bytes``,
default 128 MiB) bounds the store: the oldest go first, and a response larger
than the whole budget is not kept.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from afm_core.api.responses_store import (
    DEFAULT_MAX_BYTES,
    ResponseStore,
    StoredResponse,
    stored_size,
)
from afm_http import ServerConfig
from afm_http.testing import running_server


def _stored(rid: str, size: int) -> StoredResponse:
    return StoredResponse(response={"id": rid, "output": [], "instructions": "x" * size}, input_items=())


def test_the_store_evicts_by_bytes() -> None:
    now = [0.0]
    store = ResponseStore(100, 3600, max_bytes=10_000, clock=lambda: now[0])
    for i in range(5):
        assert store.put(_stored(f"r{i}", 3000))
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    assert store.bytes == sum(stored_size(_stored(f"r{i}", 3000)) for i in (2, 3, 4)) <= 10_000
    assert not store.put(_stored("huge", 20_000)) and store.get("huge") is None and len(store) == 3
    assert store.put(_stored("r4", 10))  # replacing one frees its bytes
    assert store.bytes < 7000
    assert store.delete("r3") and not store.delete("r3")
    now[0] = 4000  # expiry frees bytes too
    assert len(store) == 0 and store.bytes == 0
    with pytest.raises(ValueError):
        ResponseStore(max_bytes=-1)
    assert DEFAULT_MAX_BYTES == 128 << 20


def test_unicode_counts_in_utf8_bytes() -> None:
    assert stored_size(_stored("a", 0)) + 3 * 100 == stored_size(
        StoredResponse(response={"id": "a", "output": [], "instructions": "€" * 100}, input_items=()))


async def test_big_schemas_do_not_pile_up(echo_model_dir: Path) -> None:
    budget = 3 << 20
    schema = {"type": "object", "description": "d" * (1 << 20)}  # 1 MiB echoed by every response
    cfg = ServerConfig(responses_store_bytes=budget)
    async with running_server(echo_model_dir, server=cfg) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=120) as c:
        ids = []
        for i in range(8):
            r = await c.post("/v1/responses", json={
                "input": f"hello {i}", "text": {"format": {"type": "json_schema", "name": "big",
                                                           "strict": False, "schema": schema}}})
            assert r.status_code == 200, r.text[:300]
            ids.append(r.json()["id"])
        kept = [rid for rid in ids if (await c.get(f"/v1/responses/{rid}")).status_code == 200]
        assert 1 <= len(kept) <= 3 and kept == ids[-len(kept):]  # the newest, within the budget
        r = await c.post("/v1/responses", json={"input": "continue", "previous_response_id": ids[0]})
        assert r.status_code == 404  # evicted: as if deleted
