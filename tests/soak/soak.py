"""Soak: many streaming and non-streaming requests with cancels and disconnects.

A real hypercorn server on 127.0.0.1 (the app built here, so its in-flight
registry is visible) over the echo model and, optionally, the tiny random
model.  Each request is, at random:

* ~30% cancelled by id (``POST /v1/chat/completions/{id}/cancel``) at a random
  moment: before the request is sent, right after its headers (often still
  queued: ``max_batch`` is small), or after a few chunks;
* ~10% abandoned by the client mid-stream (the connection is dropped);
* ~8% read slowly (a pause after each chunk, streamed ones): every byte
  must still arrive, the write timeout must not cut a client that reads;
* the rest run to the end, streaming or not;

each through one of the wire APIs, at random: chat completions, completions,
Anthropic messages, responses (``tests/soak/apis.py``).

Every completed echo stream's text must equal the prompt exactly; a cancelled
one must be a prefix of it; a request that takes longer than ``--hang-seconds``
is a hang (a failure).  Answers that are not 2xx are counted by API and status.  At the end: engine running/waiting/active are
0, the engine and app in-flight registries are empty, and the Trio task and
thread counts are back to their baseline.  RSS is reported at start, after each
tenth of the requests, and at the end.

    .venv/bin/python tests/soak/soak.py --requests 10000 --concurrency 48 --json out.json
    .venv/bin/python tests/soak/soak.py --requests 3000 --concurrency 48
    .venv/bin/python tests/soak/soak.py --model random --requests 1000

``tests/test_soak.py`` runs a short version in CI through :func:`soak`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
from hypercorn.trio import serve

from afm_core._engine.engine import open_engine
from afm_http import ServerConfig, create_app, hypercorn_config

if __package__ in (None, ""):  # run as a script: the checkout's root makes `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.soak.apis import APIS, PATHS, StreamReader, read_body
from tests.soak.apis import payload as make_payload

CHAT = "/v1/chat/completions"
CONNECTION_TASK = "trio._highlevel_serve_listeners._run_handler"
IDLE_TASK = "hypercorn.trio.tcp_server.TCPServer._idle_timeout"
CONNECTIONS = Counter({CONNECTION_TASK: 10**9, IDLE_TASK: 10**9})
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "river", "stone", "light", "quiet", "seven",
         "orbit", "maple", "north", "cable", "ember", "x", "42", "node", "tide", "glass")


def rss_kib() -> int:
    """Resident set size of this process in KiB (psutil if present, else /proc)."""
    try:
        import psutil  # type: ignore[import-not-found]

        return int(psutil.Process().memory_info().rss // 1024)
    except ImportError:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    return -1


def task_names() -> Counter[str]:
    """Live Trio tasks in this run (descendants of the root task), by name."""
    names: Counter[str] = Counter()
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        names[task.name] += 1
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return names


@dataclass
class Report:
    model: str
    requests: int = 0
    concurrency: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    cancels_sent: int = 0
    cancels_accepted: int = 0
    cancelled_before_first_token: int = 0
    abandons: int = 0
    slow_readers: int = 0
    hangs: int = 0
    non_2xx: Counter[str] = field(default_factory=Counter)
    """Answers that were not 2xx, by ``api:status`` (cancels by ``cancel:status``)."""
    exact: int = 0
    failures: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    rss_start_kib: int = 0
    rss_end_kib: int = 0
    rss_samples_kib: list[int] = field(default_factory=list)  # after each tenth of the requests
    leaked_tasks: int = 0
    lingering_connections: int = 0
    leaked_task_names: dict[str, int] = field(default_factory=dict)
    leaked_threads: list[str] = field(default_factory=list)
    engine_inflight: int = 0
    app_inflight: int = 0
    final_stats: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["outcomes"] = dict(self.outcomes)
        d["non_2xx"] = dict(self.non_2xx)
        d["failures"] = self.failures[:20]
        d["failure_count"] = len(self.failures)
        return d

    @property
    def ok(self) -> bool:
        return (not self.failures and not self.hangs and not self.leaked_tasks and not self.leaked_threads
                and not self.engine_inflight and not self.app_inflight
                and self.final_stats.get("running") == 0 and self.final_stats.get("requests_active") == 0
                and self.final_stats.get("waiting") == 0)


async def soak(model_dir: Path, *, model: str = "echo", requests: int = 300, concurrency: int = 48,
               max_batch: int = 8, seed: int = 0, max_words: int = 120,
               apis: tuple[str, ...] = APIS, hang_seconds: float = 120.0) -> Report:
    rng = random.Random(seed)
    rep = Report(model=model, requests=requests, concurrency=concurrency)
    echo = model == "echo"

    async with open_engine(model_dir, max_batch=max_batch, max_waiting=4 * concurrency,
                           grammar=False) as engine, trio.open_nursery() as server_nursery:
        app = create_app(engine, ServerConfig())
        binds = await server_nursery.start(serve, app, hypercorn_config("127.0.0.1", 0, quiet=True))
        url = binds[0]
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as warm:
            r = await warm.post(CHAT, json={"messages": [{"role": "user", "content": "warm up"}]})
            assert r.json()["choices"][0]["message"]["content"] == "warm up" or not echo
        await trio.sleep(0.5)
        names_before = task_names()
        threads_before = {t.ident for t in threading.enumerate()}
        rep.rss_start_kib = rss_kib()
        t0 = time.perf_counter()

        plan = []
        for i in range(requests):
            roll = rng.random()
            kind = "cancel" if roll < 0.30 else "abandon" if roll < 0.40 else "slow" if roll < 0.48 \
                else "complete"
            words = rng.randint(1, max_words)
            text = f"r{i} " + " ".join(rng.choice(WORDS) for _ in range(words))
            plan.append((i, kind, text, rng.random() < 0.75, rng.random(), rng.randint(1, 12),
                         apis[i % len(apis)]))

        def fail(msg: str) -> None:
            rep.failures.append(msg)

        async def one(client: httpx.AsyncClient, item: tuple[Any, ...]) -> None:
            i, kind, text, streaming, moment, after_chunks, api = item
            rid = f"soak-{seed}-{i}"
            extra: dict[str, Any] = {}
            if not echo:
                extra = {"max_tokens": rng.randint(1, 48), "temperature": 0.7}
            payload = await make_payload(client, api, text, streaming=streaming, extra=extra)
            path = PATHS[api]
            rep.outcomes[f"api_{api}"] += 1
            headers = {"X-Request-ID": rid}
            accepted = False

            async def cancel() -> None:
                nonlocal accepted
                rep.cancels_sent += 1
                r = await client.post(f"{CHAT}/{rid}/cancel")
                if r.status_code == 200:
                    assert r.json()["cancelled"] is True
                    accepted = True
                    rep.cancels_accepted += 1
                elif r.status_code != 404:
                    rep.non_2xx[f"cancel:{r.status_code}"] += 1
                    fail(f"{rid}: cancel answered {r.status_code}")

            if kind == "cancel" and moment < 0.1:
                await cancel()  # before the request exists: 404, then it runs to the end
            if not streaming:
                if kind == "cancel" and moment >= 0.1:
                    async with trio.open_nursery() as n:
                        result: dict[str, Any] = {}

                        async def post() -> None:
                            result["r"] = await client.post(path, json=payload, headers=headers)

                        n.start_soon(post)
                        await trio.sleep(moment * 0.05)
                        await cancel()
                    r = result["r"]
                elif kind == "abandon":
                    with trio.move_on_after(moment * 0.05):
                        await client.post(path, json=payload, headers=headers)
                        rep.outcomes["abandon_too_late"] += 1
                        return
                    rep.abandons += 1
                    rep.outcomes["abandoned"] += 1
                    return
                else:
                    r = await client.post(path, json=payload, headers=headers)
                if r.status_code != 200:
                    rep.non_2xx[f"{api}:{r.status_code}"] += 1
                    fail(f"{rid}: {api} status {r.status_code} {r.text[:200]}")
                    return
                got, finish = read_body(api, r.json())
                check(rid, api, text, got, finish, accepted)
                return
            reader = StreamReader(api)
            async with client.stream("POST", path, json=payload, headers=headers) as r:
                if r.status_code != 200:
                    rep.non_2xx[f"{api}:{r.status_code}"] += 1
                    fail(f"{rid}: status {r.status_code}")
                    return
                if kind == "slow":
                    rep.slow_readers += 1
                if kind == "cancel" and 0.1 <= moment < 0.4:
                    await cancel()  # right after the headers: often still queued
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    reader.feed(line[6:])
                    if reader.error is not None:
                        fail(f"{rid}: {api} error event {reader.error}")
                        return
                    if reader.done:
                        break
                    if kind == "cancel" and moment >= 0.4 and reader.chunks == after_chunks:
                        await cancel()
                    if kind == "slow":
                        await trio.sleep(0.002 * after_chunks)  # a client that reads, slowly
                    if kind == "abandon" and reader.chunks == after_chunks:
                        rep.abandons += 1
                        rep.outcomes["abandoned"] += 1
                        return  # leaving the block drops the connection mid-stream
                else:
                    fail(f"{rid}: the {api} body ended before its end event")
                    return
            if kind == "abandon":
                rep.outcomes["abandon_too_late"] += 1
            check(rid, api, text, reader.text, reader.finish, accepted)

        def check(rid: str, api: str, text: str, got: str, finish: str | None,
                  accepted: bool) -> None:
            if accepted:
                if finish not in ("cancelled", "stop", "length"):
                    fail(f"{rid}: accepted cancel but finish {finish!r}")
                if api == "messages" and finish == "stop" and got != text:
                    finish = "cancelled"  # Anthropic's cancelled message ends with end_turn
            if finish == "cancelled":
                rep.outcomes["cancelled"] += 1
                if not got:
                    rep.cancelled_before_first_token += 1
                if not accepted:
                    fail(f"{rid}: cancelled without an accepted cancel")
                if echo and not text.startswith(got):
                    fail(f"{rid}: cancelled text is not a prefix: {got[:80]!r}")
                return
            rep.outcomes[f"finished_{finish}"] += 1
            if echo:
                if finish != "stop" or got != text:
                    fail(f"{rid}: finish {finish!r}, text {got[:60]!r} != {text[:60]!r}")
                else:
                    rep.exact += 1
            elif finish not in ("stop", "length"):
                fail(f"{rid}: finish {finish!r}")

        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as client:
            queue = iter(plan)

            done = 0
            tenth = max(1, requests // 10)

            async def worker() -> None:
                nonlocal done
                for item in queue:
                    try:
                        with trio.move_on_after(hang_seconds) as limit:
                            await one(client, item)
                        if limit.cancelled_caught:
                            rep.hangs += 1
                            fail(f"soak-{seed}-{item[0]}: no answer within {hang_seconds:g} s (a hang)")
                    except Exception as exc:  # noqa: BLE001 - a soak failure, reported
                        fail(f"soak-{seed}-{item[0]}: {type(exc).__name__}: {exc}")
                    done += 1
                    if done % tenth == 0:
                        rep.rss_samples_kib.append(rss_kib())

            async with trio.open_nursery() as n:
                for _ in range(concurrency):
                    n.start_soon(worker)
        rep.duration_s = round(time.perf_counter() - t0, 2)

        # settle: server-side connection tasks end, trio's idle worker threads expire (~10 s)
        with trio.move_on_after(30):
            while (engine.statistics().requests_active or len(app.afm_inflight)
                   or sum((task_names() - names_before - CONNECTIONS).values())
                   or {t.ident for t in threading.enumerate()} - threads_before):
                await trio.sleep(0.2)
        stats = engine.statistics()
        rep.final_stats = {"running": stats.running, "waiting": stats.waiting,
                           "requests_active": stats.requests_active, "requests_total": stats.requests_total,
                           "finished": stats.finished, "generation_tokens": stats.generation_tokens}
        rep.engine_inflight = len(engine._inflight) + len(engine._by_key)
        rep.app_inflight = len(app.afm_inflight)
        extra = task_names() - names_before
        # hypercorn keeps a connection whose client closed it after a completed stream until
        # its keep-alive timeout (75 s; CLOSE-WAIT): counted apart, see test_soak.py
        rep.lingering_connections = extra.pop(CONNECTION_TASK, 0)
        extra.pop(IDLE_TASK, None)
        rep.leaked_tasks = sum(extra.values())
        rep.leaked_task_names = dict(extra)
        rep.leaked_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before]
        # the server still serves exactly
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "after the soak"}]})
            if r.status_code != 200 or (echo and r.json()["choices"][0]["message"]["content"] != "after the soak"):
                fail(f"after the soak: {r.status_code} {r.text[:200]}")
        rep.rss_end_kib = rss_kib()
        server_nursery.cancel_scope.cancel()
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("echo", "random"), default="echo")
    p.add_argument("--model-dir", type=Path, help="an existing test model directory")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hang-seconds", type=float, default=120.0,
                   help="a request without its answer after this long is a hang")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    from afm_core.testing import make_echo_model, make_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or (make_echo_model if args.model == "echo" else make_random_model)(Path(tmp))
        rep = trio.run(lambda: soak(model_dir, model=args.model, requests=args.requests,
                                    concurrency=args.concurrency, max_batch=args.max_batch,
                                    seed=args.seed, max_words=args.max_words,
                                    hang_seconds=args.hang_seconds))
    d = rep.as_dict()
    print(json.dumps(d, indent=1))
    print(f"\nsoak {rep.model}: {rep.requests} requests at {rep.concurrency} concurrency in {rep.duration_s} s; "
          f"cancels sent {rep.cancels_sent} (accepted {rep.cancels_accepted}, "
          f"{rep.cancelled_before_first_token} before the first token), abandons {rep.abandons}, "
          f"slow readers {rep.slow_readers}, hangs {rep.hangs}, non-2xx {dict(rep.non_2xx) or 0}, "
          f"exact {rep.exact}; RSS {rep.rss_start_kib} -> {rep.rss_end_kib} KiB "
          f"(by tenths: {', '.join(str(k // 1024) for k in rep.rss_samples_kib)} MiB); leaked tasks "
          f"{rep.leaked_tasks} (+{rep.lingering_connections} lingering keep-alive connections), threads {len(rep.leaked_threads)}, in-flight engine {rep.engine_inflight} "
          f"app {rep.app_inflight}; failures {len(rep.failures)}; {'OK' if rep.ok else 'FAILED'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(d, indent=1) + "\n")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
