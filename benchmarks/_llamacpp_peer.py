"""llama.cpp's own server loop on a GGUF, in a child process, for the kernel benchmarks.

``xllamacpp`` (PyPI, prebuilt) wraps
``llama-server``'s ``server_context``: continuous batching over ``n_parallel``
slots and its HTTP endpoints.  :func:`llama_server` starts it in a child
process (so its threads and memory are its own, and an idle server sleeps
while afm runs) and yields a :class:`Peer` that decodes on it:

* :meth:`Peer.decode` one greedy completion of ``n`` tokens after a prompt
  of token ids, its decode rate from llama.cpp's own timings (the prompt
  excluded, as afm's side of the benchmarks times its decode steps only);
* :meth:`Peer.decode_many` the same for several prompts at once (one slot
  each, batched by the server loop): the aggregate decode rate, all tokens
  over the longest slot's decode time;
* :meth:`Peer.tokenize` llama.cpp's tokenization, so both sides decode after
  the same ids.

Run as a script it is that child: ``python _llamacpp_peer.py FILE PORT THREADS PARALLEL CTX``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Peer", "llama_server"]


@dataclass
class Peer:
    """A running llama.cpp server."""

    url: str
    threads: int
    parallel: int
    pid: int

    def cpu_seconds(self) -> float:
        """CPU time the server process used so far (all its threads)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        r = httpx.post(self.url + path, json=body, timeout=3600)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def tokenize(self, text: str) -> list[int]:
        return list(self._post("/tokenize", {"content": text, "add_special": False,
                                             "parse_special": True})["tokens"])

    def _complete(self, prompt: list[int], n: int) -> dict[str, Any]:
        return self._post("/completion", {
            "prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"],
        })

    def decode(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        """Decode tok/s of one greedy completion, the server's CPU seconds per
        token (the prompt included: it is short), and its tokens."""
        c0 = self.cpu_seconds()
        r = self._complete(prompt, n)
        cpu = self.cpu_seconds() - c0
        t = r["timings"]
        return (t["predicted_n"] / (t["predicted_ms"] / 1e3), cpu / t["predicted_n"],
                list(r.get("tokens") or []))

    def decode_many(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        """Aggregate decode tok/s of one completion per prompt, all at once:
        all tokens over the time from the first slot's first token to the
        last token (a later slot's prompt, processed meanwhile, counts against
        it: the prompts are short); and the server's CPU seconds per token."""
        c0 = self.cpu_seconds()
        with ThreadPoolExecutor(len(prompts)) as pool:
            starts_ends = list(pool.map(lambda p: self._timed(p, n), prompts))
        cpu = self.cpu_seconds() - c0
        tokens = sum(r["timings"]["predicted_n"] for r, _ in starts_ends)
        # each slot's decode ends at its response, and began predicted_ms earlier
        first = min(end - r["timings"]["predicted_ms"] / 1e3 for r, end in starts_ends)
        last = max(end for _, end in starts_ends)
        return tokens / (last - first), cpu / tokens

    def _timed(self, prompt: list[int], n: int) -> tuple[dict[str, Any], float]:
        r = self._complete(prompt, n)
        return r, time.perf_counter()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_server(gguf: Path, threads: int, parallel: int = 8, ctx: int = 8192,
                 env: dict[str, str] | None = None) -> Iterator[Peer]:
    """A llama.cpp server on ``gguf`` with ``threads`` threads and ``parallel`` slots."""
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, __file__, str(gguf), str(port), str(threads),
                             str(parallel), str(ctx)],
                            env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama.cpp's server exited ({proc.returncode}) loading {gguf}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("llama.cpp's server did not start within 10 minutes")
            time.sleep(0.5)
        yield Peer(url, threads, parallel, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve(gguf: str, port: int, threads: int, parallel: int, ctx: int) -> int:
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = gguf
    p.hostnames = ["127.0.0.1"]
    p.port = port
    p.n_parallel = parallel
    p.n_ctx = ctx
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.warmup = True
    server = xlc.Server(p)
    print(json.dumps({"system_info": xlc.get_system_info()}), flush=True)
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    while not stop:
        time.sleep(0.2)
    del server
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                    int(sys.argv[5])))
