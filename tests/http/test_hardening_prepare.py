"""Issue 31, case 4: one slow request blocked everyone's preparation.

Every request was templated and tokenized in one two-thread pool, first come
first served: two 8 MB ``/tokenize`` calls made a 3-token chat wait 19 s, the
work went on after the clients left, ``/tokenize`` was not counted against
the queue limits and ran during a drain, and one 8 MB ``/tokenize`` peaked at
1.6 GB.  Now work is done in two lanes by cost (small requests never wait
behind large ones), a client that leaves stops its work, ``/tokenize`` (and
``/detokenize``, the counting routes) count toward ``max_batch +
max_waiting`` and are refused while draining, a prompt too long for the
context stops being tokenized as soon as that is known, and a long text is
tokenized in pieces (memory bounded).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import trio

from afm_http.testing import running_server
from tests.process import LoggedProcess

CHAT = "/v1/chat/completions"
LINE = "the quick brown fox jumps over the lazy dog, again and again.\n"


def _text(mb: float) -> str:
    return LINE * int(mb * (1 << 20) / len(LINE))


async def test_a_small_chat_does_not_wait_behind_large_preparations(echo_model_dir: Path) -> None:
    big = _text(3)
    done: list[str] = []
    async with running_server(echo_model_dir) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=300) as c, trio.open_nursery() as nursery:

        async def count(name: str) -> None:  # (a small answer: it ends when the server's work does)
            r = await c.post(f"{CHAT}/count_tokens", json={"messages": [{"role": "user", "content": big}]})
            assert r.status_code == 200 and r.json()["input_tokens"] > 100_000
            done.append(name)

        start = trio.current_time()
        await count("alone")  # how long one large preparation takes on this machine
        alone = trio.current_time() - start
        done.clear()
        nursery.start_soon(count, "large-1")
        nursery.start_soon(count, "large-2")
        await trio.sleep(alone / 4)  # (the first large call is under way, the second waits for it)
        r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["choices"][0]["message"]["content"] == "hi"
        done.append("small")
    # behind both large calls (one lane) the small one would end last; in its own lane it
    # passes at least the one still waiting (which ends about 2 x alone after they started)
    assert done.index("small") < done.index("large-2"), (done, alone)


async def test_a_client_that_leaves_stops_its_preparation(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url, timeout=300) as c:
        with trio.move_on_after(1):  # leaves while the text is being tokenized
            await c.post("/tokenize", json={"content": _text(6)})
        with trio.fail_after(60):
            while engine.statistics().preparations_abandoned < 1:
                await trio.sleep(0.05)
        r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "next"}]})
        assert r.json()["choices"][0]["message"]["content"] == "next"


async def test_tokenize_counts_toward_the_queue_limits(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir, max_batch=1, max_waiting=0) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=60) as c:
        long = " ".join(f"w{i}" for i in range(3000))
        async with c.stream("POST", CHAT, json={"messages": [{"role": "user", "content": long}],
                                                 "stream": True}) as held:
            assert held.status_code == 200
            for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1, 2]}),
                               (f"{CHAT}/count_tokens", {"messages": [{"role": "user", "content": "x"}]})):
                r = await c.post(path, json=body)
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_busy", path
        assert (await c.post("/tokenize", json={"content": "hi"})).status_code == 200


async def test_tokenize_is_refused_while_draining(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url, timeout=60) as c:
        assert (await c.post("/admin/drain")).status_code == 202
        for path, body in (("/tokenize", {"content": "hi"}), ("/v1/embeddings", {"input": "hi"}),
                           ("/detokenize", {"tokens": [1]}), ("/v1/messages/count_tokens", {})):
            r = await c.post(path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", path
        assert (await c.delete("/admin/drain")).status_code == 200
        assert (await c.post("/tokenize", json={"content": "hi"})).status_code == 200


async def test_a_prompt_too_long_stops_being_tokenized(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url, timeout=300) as c:
        r = await c.post(CHAT, json={"messages": [{"role": "user", "content": _text(6)}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded"
        # it stopped soon after the context's 32,768 tokens, not after the 1.5 million of the text
        count = int(err["message"].split("at least ")[1].split(" ")[0])
        assert 32768 <= count < 200_000, err["message"]


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_large_tokenize_has_bounded_memory(echo_model_dir: Path) -> None:
    """``afm serve`` in a child process: its peak RSS grows by far less than the
    1.6 GB one 8 MB ``/tokenize`` took (the ids and their JSON remain)."""
    if not Path("/proc/self/status").exists():
        import pytest

        pytest.skip("reads the peak RSS from /proc")
    server = LoggedProcess([sys.executable, "-m", "afm_core._cli", "serve", "--quiet", "--port", "0",
                            "--no-warmup", "--no-ui", "--model", str(echo_model_dir)])
    try:
        found = server.wait_for(r"serving .* on (http://127\.0\.0\.1:\d+)", timeout=120)
        assert found, server.log()
        url = found.group(1)
        assert httpx.post(url + "/tokenize", json={"content": "warm"}, timeout=60).status_code == 200
        before = _peak_rss_kib(server.proc.pid)
        r = httpx.post(url + "/tokenize", json={"content": _text(7.5)}, timeout=600)
        assert r.status_code == 200
        n = len(r.json()["tokens"])
        grown = _peak_rss_kib(server.proc.pid) - before
        # the ids (a Python list) and the JSON body are what remains: ~100 bytes a token
        print(f"\npeak RSS grew by {grown // 1024} MiB for {n} tokens")
        assert grown < 120 * n // 1024 + 200_000, (grown, n)
    finally:
        server.kill()
