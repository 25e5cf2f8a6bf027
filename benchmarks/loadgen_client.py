"""The load generator's own CPU: httpx against afm bench's HTTP client.

    .venv/bin/python benchmarks/loadgen_client.py [--streams 8] [--requests 64] [--chunks 64]

``afm bench`` runs on the machine it measures, so every core-second its client
spends is taken from the servers.  This starts a stub SSE server in another
process (one chunked frame per token, as the servers stream; ``--gap-ms``
between frames) and streams ``--requests`` answers through ``--streams``
concurrent connections, once with httpx (the load generator's client before)
and once with ``afm_core.bench._http.Client``, both parsing the frames with
the same ``SSEParser``.  It prints the client's CPU per streamed frame and in
cores; the frames each side received are checked to be the same.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial

import httpx
import trio

from afm_core.bench._http import Client, read_request
from afm_core.bench._loadgen import SSEParser
from afm_core.bench._servers import free_port

FRAME = b"data: " + json.dumps({"id": "chatcmpl-x", "object": "chat.completion.chunk", "choices": [
    {"index": 0, "delta": {"content": " word"}, "finish_reason": None}]}).encode() + b"\n\n"


async def stub_server(port: int, chunks: int, gap: float) -> None:
    async def handle(stream: trio.SocketStream) -> None:
        buf = bytearray()
        async with stream:
            while await read_request(stream, buf) is not None:
                await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                      b"Transfer-Encoding: chunked\r\n\r\n")
                for _ in range(chunks):
                    await stream.send_all(b"%x\r\n%s\r\n" % (len(FRAME), FRAME))
                    await trio.sleep(gap)
                done = b"data: [DONE]\n\n"
                await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    await trio.serve_tcp(handle, port, host="127.0.0.1")


async def with_httpx(url: str, streams: int, requests: int) -> int:
    frames = 0
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) as client:
        async def one() -> None:
            nonlocal frames
            parser = SSEParser()
            async with client.stream("POST", url + "/v1/chat/completions", json={"stream": True}) as resp:
                async for raw in resp.aiter_raw():
                    frames += len(parser.feed(raw))
        await _closed_loop(one, streams, requests)
    return frames


async def with_afm(url: str, streams: int, requests: int) -> int:
    frames = 0
    body = json.dumps({"stream": True}).encode()
    async with Client(url, max_connections=streams) as client:
        async def one() -> None:
            nonlocal frames
            parser = SSEParser()
            async with client.post("/v1/chat/completions", body) as resp:
                async for raw in resp.iter_bytes():
                    frames += len(parser.feed(raw))
        await _closed_loop(one, streams, requests)
    return frames


async def _closed_loop(one: Callable[[], Awaitable[None]], streams: int, requests: int) -> None:
    left = [requests]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            await one()

    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            nursery.start_soon(worker)


def _wait_listening(port: int) -> None:
    import socket

    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("the stub server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=64, help="frames per answer")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="pause between frames")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve-stub", str(port), str(args.chunks),
                               str(args.gap_ms / 1000)])
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_listening(port)
        print(f"{args.streams} streams, {args.requests} answers of {args.chunks} frames, "
              f"{args.gap_ms:g} ms apart; stub server in another process")
        for _ in range(args.repeats):
            for name, fn in (("httpx", with_httpx), ("afm client", with_afm)):
                t0, c0 = time.perf_counter(), time.process_time()
                frames = trio.run(fn, url, args.streams, args.requests)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                expected = args.requests * (args.chunks + 1)
                assert frames == expected, (name, frames, expected)
                print(f"  {name:10s} {cpu / frames * 1e6:6.1f} µs CPU per frame, "
                      f"{cpu / wall:.2f} cores over {wall:.2f} s")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve-stub":
        trio.run(partial(stub_server, int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
    else:
        main()
