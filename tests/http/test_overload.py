"""Overload: with the waiting queue full, new requests get 503 + Retry-After at once,
running streams continue unharmed, queued ones complete exactly, and service
resumes when load drops.  Real hypercorn on 127.0.0.1, echo model.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio

from afm_http.testing import running_server
from tests.http.helpers import CHAT, body

MAX_BATCH, MAX_WAITING = 2, 2


async def test_full_queue_is_503_while_streams_continue(echo_model_dir: Path) -> None:
    """Two long streams run, two short ones wait: the engine is full.  New requests are
    refused at once; the running streams keep streaming exact text through it; when
    they are cancelled the queued ones run and complete exactly, and service resumes."""
    async with running_server(echo_model_dir, max_batch=MAX_BATCH, max_waiting=MAX_WAITING) as (url, engine), \
            httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=64), timeout=120) as c:
        long_text = {i: f"long stream {i} " + "word " * 8000 for i in range(MAX_BATCH)}
        short_text = {i: f"queued stream {i} says hello" for i in range(MAX_BATCH, MAX_BATCH + MAX_WAITING)}
        texts = {**long_text, **short_text}
        got: dict[int, list[str]] = {i: [] for i in texts}
        finish: dict[int, str] = {}
        overload_done = trio.Event()
        after_overload: dict[int, int] = {i: 0 for i in texts}

        async def stream(i: int) -> None:
            async with c.stream("POST", CHAT, json=body(texts[i], stream=True),
                                headers={"X-Request-ID": f"held-{i}"}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk
                    ch = chunk["choices"][0]
                    got[i].append(ch["delta"].get("content") or "")
                    finish[i] = ch["finish_reason"] or finish.get(i, "")
                    after_overload[i] += overload_done.is_set()

        async with trio.open_nursery() as n:
            for i in long_text:
                n.start_soon(stream, i)
            with trio.fail_after(30):
                while engine.statistics().running < MAX_BATCH or not all(got[i] for i in long_text):
                    await trio.sleep(0.01)
            for i in short_text:
                n.start_soon(stream, i)
            with trio.fail_after(30):
                while engine.statistics().requests_active < MAX_BATCH + MAX_WAITING:
                    await trio.sleep(0.01)
            # every new request, streaming or not, is refused at once with the envelope
            for k in range(40):
                assert engine.statistics().requests_active == MAX_BATCH + MAX_WAITING, \
                    "a long stream ended during the overload: make it longer"
                r = await c.post(CHAT, json=body(f"overflow {k}", stream=k % 2 == 0))
                assert r.status_code == 503, r.text
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == "engine_busy"
                assert r.headers["x-request-id"] == r.headers["openai-request-id"]
            # health and metrics still answer under overload
            assert (await c.get("/health")).status_code == 200
            assert "afm_requests_running" in (await c.get("/metrics")).text
            overload_done.set()
            with trio.fail_after(30):  # the running streams are still streaming
                while not all(after_overload[i] >= 5 for i in long_text):
                    await trio.sleep(0.01)
            for i in long_text:
                assert (await c.post(f"{CHAT}/held-{i}/cancel")).status_code == 200
        for i in long_text:
            assert finish[i] == "cancelled" and texts[i].startswith("".join(got[i]))
            assert len(got[i]) > 10
        for i in short_text:
            assert finish[i] == "stop" and "".join(got[i]) == texts[i]

        with trio.fail_after(20):
            while engine.statistics().requests_active:
                await trio.sleep(0.01)
        # load dropped: served again, concurrently up to the limit
        results: dict[int, str] = {}

        async def again(i: int) -> None:
            r = await c.post(CHAT, json=body(f"served again {i}"))
            assert r.status_code == 200, r.text
            results[i] = r.json()["choices"][0]["message"]["content"]

        async with trio.open_nursery() as n:
            for i in range(MAX_BATCH + MAX_WAITING):
                n.start_soon(again, i)
        assert results == {i: f"served again {i}" for i in range(MAX_BATCH + MAX_WAITING)}
        assert engine.statistics().running == 0


async def test_bursts_beyond_capacity_get_only_200_or_503(echo_model_dir: Path) -> None:
    """A burst 4x the capacity: each request is served exactly or refused with 503."""
    async with running_server(echo_model_dir, max_batch=MAX_BATCH, max_waiting=MAX_WAITING) as (url, engine), \
            httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=64), timeout=120) as c:
        for burst in range(3):
            statuses: dict[int, int] = {}

            async def one(i: int, burst: int = burst, statuses: dict[int, int] = statuses) -> None:
                text = f"burst {burst} request {i} " + "word " * (i % 7) * 20
                r = await c.post(CHAT, json=body(text))
                statuses[i] = r.status_code
                if r.status_code == 200:
                    assert r.json()["choices"][0]["message"]["content"] == text
                else:
                    assert r.status_code == 503 and r.headers["retry-after"], r.text
                    assert r.json()["error"]["code"] == "engine_busy"

            async with trio.open_nursery() as n:
                for i in range(4 * (MAX_BATCH + MAX_WAITING)):
                    n.start_soon(one, i)
            assert set(statuses.values()) <= {200, 503} and 200 in statuses.values()
            with trio.fail_after(20):
                while engine.statistics().requests_active:
                    await trio.sleep(0.01)
        r = await c.post(CHAT, json=body("calm again"))
        assert r.json()["choices"][0]["message"]["content"] == "calm again"


async def test_faults_in_some_concurrent_streams_leave_the_others_exact(
        echo_model_dir: Path, monkeypatch) -> None:
    """Every third stream's pipeline raises at its end: those streams end with the
    error-marked chunk then [DONE]; the other concurrent streams are exact."""
    import afm_core._engine.prepare
    from afm_core._stream.pipeline_py import StreamPipeline as PyPipeline

    made = {"n": 0}

    class FaultyPipeline(PyPipeline):  # the pure twin, built where the engine builds pipelines
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made["n"] += 1
            self.faulty = made["n"] % 3 == 0

        def finish(self, out):
            if self.faulty:
                raise RuntimeError("injected concurrent fault")
            return super().finish(out)

    monkeypatch.setattr(afm_core._engine.prepare, "StreamPipeline", FaultyPipeline)
    async with running_server(echo_model_dir, max_batch=4) as (url, engine), \
            httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=64), timeout=120) as c:
        outcome: dict[int, str] = {}

        async def one(i: int) -> None:
            text = f"concurrent {i} " + "word " * (20 + i * 3)
            parts, last = [], None
            async with c.stream("POST", CHAT, json=body(text, stream=True)) as r:
                lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            for ln in lines[:-1]:
                last = json.loads(ln[6:])
                if last.get("choices"):
                    parts.append(last["choices"][0]["delta"].get("content") or "")
            assert "".join(parts) == text
            if "error" in last:
                assert "injected concurrent fault" in last["error"]["message"]
                assert set(last["error"]) == {"message", "type", "param", "code"}
                outcome[i] = "error"
            else:
                assert last["choices"][0]["finish_reason"] == "stop"
                outcome[i] = "stop"

        async with trio.open_nursery() as n:
            for i in range(12):
                n.start_soon(one, i)
        assert list(outcome.values()).count("error") == 4 and len(outcome) == 12
        assert engine.healthy
        monkeypatch.undo()
        r = await c.post(CHAT, json=body("still fine"))
        assert r.json()["choices"][0]["message"]["content"] == "still fine"
        with trio.fail_after(20):
            while engine.statistics().requests_active:
                await trio.sleep(0.01)
