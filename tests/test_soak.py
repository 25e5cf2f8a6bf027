"""A short soak in CI: ~300 echo requests at 48 concurrency, ~30% cancelled by id
(some while queued: max_batch=8), ~10% abandoned mid-stream, ~8% read slowly; the
long version is ``tests/soak/soak.py`` (10,000 requests)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio

from afm_http.testing import running_server
from tests.soak.soak import CONNECTION_TASK, soak, task_names


async def test_short_soak_echo(echo_model_dir: Path) -> None:
    rep = await soak(echo_model_dir, requests=300, concurrency=48, max_batch=8, seed=7, max_words=60)
    print("\nsoak:", json.dumps(rep.as_dict()))
    assert not rep.failures, rep.failures[:5]
    stats = rep.final_stats
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["requests_active"] == 0
    assert rep.engine_inflight == 0 and rep.app_inflight == 0
    assert rep.leaked_tasks == 0, rep.leaked_task_names
    assert rep.leaked_threads == []
    assert rep.cancels_accepted >= 30 and rep.abandons >= 10 and rep.exact >= 100
    assert rep.slow_readers >= 5 and rep.hangs == 0 and not rep.non_2xx
    assert rep.cancelled_before_first_token >= 1  # cancelled while queued / before decoding


async def test_short_soak_random_model(random_model_dir: Path) -> None:
    rep = await soak(random_model_dir, model="random", requests=120, concurrency=32, max_batch=4, seed=3)
    assert not rep.failures, rep.failures[:5]
    assert rep.final_stats["running"] == 0 and rep.final_stats["requests_active"] == 0
    assert rep.engine_inflight == 0 and rep.app_inflight == 0
    assert rep.leaked_tasks == 0 and rep.leaked_threads == []


async def test_closed_connection_after_a_stream_is_released(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        await trio.sleep(0.2)
        before = task_names()[CONNECTION_TASK]
        async with httpx.AsyncClient(base_url=url) as c:
            async with c.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "short"}], "stream": True}) as r:
                async for _ in r.aiter_lines():
                    pass
        with trio.move_on_after(5):
            while task_names()[CONNECTION_TASK] > before:
                await trio.sleep(0.05)
        assert task_names()[CONNECTION_TASK] == before


async def test_connection_released_when_client_leaves_at_done(echo_model_dir: Path) -> None:
    """A client that stops reading at ``[DONE]`` (before the chunked terminator) and closes."""
    async with running_server(echo_model_dir) as (url, _):
        await trio.sleep(0.2)
        before = task_names()[CONNECTION_TASK]
        async with httpx.AsyncClient(base_url=url) as c:
            for _ in range(6):
                async with c.stream("POST", "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "short"}], "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            break
        with trio.move_on_after(5):
            while task_names()[CONNECTION_TASK] > before:
                await trio.sleep(0.05)
        assert task_names()[CONNECTION_TASK] == before
