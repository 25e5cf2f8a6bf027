"""``--kv-bits`` seen from HTTP: ``/health`` and ``X-AFM-Profile`` say the KV
cache is quantized, and a streamed chat runs on it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from afm_core.testing import make_random_model
from afm_http.testing import running_server

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head size 64: a multiple of the default group size
    return make_random_model(tmp_path_factory.mktemp("kvh"), hidden_size=256, num_heads=4, num_kv_heads=2)


async def test_health_and_profile_report_kv_bits(model_dir: Path) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    async with running_server(model_dir, kv_bits=4, warmup=False) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=60) as c:
        health = (await c.get("/health")).json()
        assert health["kv_cache"] == {"bits": 4, "group_size": 64}
        r = await c.post(CHAT, json=body, headers={"X-AFM-Profile": "true"})
        assert r.status_code == 200 and r.json()["afm_profile"]["kv_bits"] == 4
        async with c.stream("POST", CHAT, json={**body, "stream": True}) as s:
            lines = [line async for line in s.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) > 2
    async with running_server(model_dir, warmup=False) as (url, _), httpx.AsyncClient(base_url=url) as c:
        assert "kv_cache" not in (await c.get("/health")).json()
