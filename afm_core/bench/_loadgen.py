"""The load generator: streamed requests of one wire API (chat completions by
default; see ``_apis``) against a served URL, closed-loop (fixed concurrency)
or open-loop (Poisson arrivals).

``SSEParser`` is a sans-IO parser (``feed(bytes) -> [data]``, ``flush()``);
``StreamObserver`` turns decoded chunks into timings and token counts.  The
HTTP side is the lean keep-alive client of ``_http`` (h11 on Trio).  Every
run is bounded: a request count, a per-request time budget (connecting
included) and a per-level time budget; requests still running when the level
budget ends are cancelled and counted as ``deadline`` errors.

Error kinds: ``connect``, ``timeout``, ``http_<status>``, ``transport``,
``bad_json``, ``stream_error`` (an error object or error-marked chunk in the
stream), ``no_done`` (body ended without ``[DONE]``), ``no_usage``
(``include_usage`` was ignored), ``deadline``.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import trio

from ._apis import PATHS, read_event
from ._apis import body as request_body
from ._errors import ConnectError, TransportError
from ._http import Client
from ._results import RequestResult, RunResult
from ._workload import Workload

_LINE_END = re.compile(rb"\r\n|\r|\n")
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def require_loopback(url: str) -> None:
    """Refuse any URL that is not plain http to a loopback host."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"the load generator speaks plain http (http://127.0.0.1:PORT), not {url!r}")
    host = parts.hostname or ""
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"benchmarks run on loopback only, not {host!r}")


class SSEParser:
    """Incremental server-sent-events parser; yields each event's data.

    Accepts ``\\n``, ``\\r\\n`` and ``\\r`` line ends split anywhere; comment
    lines (``:...``) and fields other than ``data`` are ignored; multiple
    ``data`` lines in one event are joined with ``\\n``.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[str]:
        events: list[str] = []
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the \n of a \r\n split across chunks
        self._pending_cr = False
        buf = self._buf + chunk
        start = 0
        for m in _LINE_END.finditer(buf):
            if m.end() == len(buf) and m.group() == b"\r":
                self._pending_cr = True
            self._line(buf[start : m.start()], events)
            start = m.end()
        self._buf = buf[start:]
        return events

    def flush(self) -> list[str]:
        """End of body: dispatch a final event missing its blank line."""
        events: list[str] = []
        if self._buf:
            self._line(self._buf, events)
            self._buf = b""
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, raw: bytes, events: list[str]) -> None:
        if not raw:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)


class StreamObserver:
    """Timings of one streamed response, fed decoded SSE data payloads.

    TTFT is the first chunk carrying content, reasoning or a tool-call delta;
    inter-token latencies are the gaps between consecutive such chunks.
    """

    def __init__(self, result: RequestResult, t0: float, *, count_chunks: bool = False,
                 api: str = "chat", keep_text: bool = False) -> None:
        self.result = result
        self.parts: list[str] | None = [] if keep_text else None
        self.t0 = t0
        self.api = api
        self.done = False
        self.saw_usage = False
        #: without usage, count token-bearing chunks as tokens instead of an error
        self.count_chunks = count_chunks
        self.chunks = 0
        self._last: float | None = None

    def data(self, payload: str, now: float) -> None:
        r = self.result
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            r.error, r.detail = "bad_json", payload[:80]
            return
        if not isinstance(obj, dict):
            r.error, r.detail = "bad_json", payload[:80]
            return
        if "afm_profile" in obj or "afm_profile_extended" in obj:
            r.profile = obj
            return
        reading = read_event(self.api, obj)
        if reading.error is not None:
            r.error, r.detail = "stream_error", reading.error
            return
        if reading.output_tokens is not None:
            self.saw_usage = True
            r.output_tokens = reading.output_tokens
        if reading.prompt_tokens is not None:
            r.prompt_tokens = reading.prompt_tokens
        if reading.finish_reason:
            r.finish_reason = reading.finish_reason
        if reading.timings is not None:
            r.timings = reading.timings
        if self.parts is not None and reading.text:
            self.parts.append(reading.text)
        if reading.done:
            self.done = True
        if reading.token:
            self.chunks += 1
            if self._last is None:
                r.ttft = now - self.t0
            else:
                r.itls.append(now - self._last)
            self._last = now

    def finish(self, now: float) -> None:
        r = self.result
        r.e2e = now - self.t0
        if self.parts is not None:
            r.text = "".join(self.parts)
        if r.error is None and not self.done:
            r.error = "no_done"
        elif r.error is None and not self.saw_usage:
            if self.count_chunks:
                r.output_tokens = self.chunks
            else:
                r.error = "no_usage"


@dataclass(frozen=True, slots=True)
class Target:
    """A served endpoint of wire API ``api`` (``_apis.APIS``); ``model`` is the
    request's model field (None omits it, which mlx_lm.server accepts)."""

    name: str
    base_url: str
    model: str | None = None
    profile: bool = False
    count_chunks: bool = False  # a server that ignores include_usage: one chunk, one token
    api: str = "chat"
    extra: tuple[tuple[str, object], ...] = ()  # fields added to every request body
    keep_text: bool = False  # keep each answer's text (RequestResult.text)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + PATHS[self.api]

    @property
    def path(self) -> str:
        """The request target on the server (the URL's path and the endpoint)."""
        return urlsplit(self.url).path


def make_client(target: Target, max_connections: int) -> Client:
    """A client sized for the level (no pool queueing on our side)."""
    return Client(target.base_url, max_connections=max_connections)


async def one_request(
    client: Client,
    target: Target,
    workload: Workload,
    index: int,
    *,
    request_timeout: float,
    t0: float | None = None,
) -> RequestResult:
    """Send job ``index`` and stream the answer.  ``t0`` is the arrival time
    latencies count from (defaults to now: the send time)."""
    job = workload.job(index)
    start = time.perf_counter() if t0 is None else t0
    result = RequestResult(index=index, start=start)
    obs = StreamObserver(result, start, count_chunks=target.count_chunks, api=target.api,
                         keep_text=target.keep_text)
    headers = [("Accept", "text/event-stream")]
    if target.profile:
        headers.append(("X-AFM-Profile", "extended"))
    fields = request_body(job, target.api, model=target.model)
    fields.update(target.extra)
    body = json.dumps(fields).encode()
    try:
        with trio.move_on_after(request_timeout) as scope:
            async with client.post(target.path, body, headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.read(200)).decode("utf-8", "replace")
                    result.error, result.detail = f"http_{resp.status_code}", text
                else:
                    parser = SSEParser()
                    async for raw in resp.iter_bytes():
                        now = time.perf_counter()
                        for data in parser.feed(raw):
                            obs.data(data, now)
                    now = time.perf_counter()
                    for data in parser.flush():
                        obs.data(data, now)
                    obs.finish(time.perf_counter())
        if scope.cancelled_caught and result.error is None:
            result.error, result.detail = "timeout", f"over {request_timeout:g} s"
    except trio.Cancelled:
        if result.error is None:
            result.error = "deadline"
        result.e2e = time.perf_counter() - start
        raise
    except ConnectError as exc:
        result.error, result.detail = "connect", str(exc)[:200]
    except TransportError as exc:
        result.error, result.detail = "transport", str(exc)[:200]
    if result.e2e is None:
        result.e2e = time.perf_counter() - start
    return result


async def run_closed(
    target: Target,
    workload: Workload,
    concurrency: int,
    n_requests: int,
    *,
    level_timeout: float,
    request_timeout: float,
    first_index: int = 0,
) -> RunResult:
    """``concurrency`` workers each send the next job as soon as their last
    one finished, until ``n_requests`` were sent or the budget ran out."""
    if concurrency < 1 or n_requests < 1:
        raise ValueError("concurrency and n_requests must be >= 1")
    results: list[RequestResult] = []
    next_index = first_index
    end_index = first_index + n_requests
    t_start = time.perf_counter()
    cpu_start = time.process_time()

    async def worker(client: Client) -> None:
        nonlocal next_index
        while next_index < end_index:
            i = next_index
            next_index += 1
            holder = RequestResult(index=i, start=time.perf_counter())
            try:
                results.append(await one_request(
                    client, target, workload, i, request_timeout=request_timeout))
            except trio.Cancelled:
                holder.error = "deadline"
                results.append(holder)
                raise

    async with make_client(target, concurrency) as client:
        with trio.move_on_after(level_timeout) as scope:
            async with trio.open_nursery() as nursery:
                for _ in range(min(concurrency, n_requests)):
                    nursery.start_soon(worker, client)
    duration = _last_end(results, t_start)
    return RunResult(target.name, "closed", float(concurrency), duration,
                     _rebase(results, t_start), truncated=scope.cancelled_caught,
                     client_cpu_s=time.process_time() - cpu_start)


async def run_open(
    target: Target,
    workload: Workload,
    rate: float,
    schedule: Sequence[float],
    *,
    level_timeout: float,
    request_timeout: float,
    first_index: int = 0,
) -> RunResult:
    """Start request ``k`` at ``schedule[k]`` seconds regardless of how many
    are in flight; latencies count from the scheduled arrival."""
    results: list[RequestResult] = []
    t_start = time.perf_counter()
    cpu_start = time.process_time()

    async def fire(i: int, t0: float) -> None:
        holder = RequestResult(index=i, start=t0)
        try:
            results.append(await one_request(
                client, target, workload, i, request_timeout=request_timeout, t0=t0))
        except trio.Cancelled:
            holder.error = "deadline"
            results.append(holder)
            raise

    async with make_client(target, max(1, len(schedule))) as client:
        with trio.move_on_after(level_timeout) as scope:
            async with trio.open_nursery() as nursery:
                for k, offset in enumerate(schedule):
                    at = t_start + offset
                    await trio.sleep(max(0.0, at - time.perf_counter()))
                    nursery.start_soon(fire, first_index + k, at)
    duration = _last_end(results, t_start)
    return RunResult(target.name, "open", rate, duration, _rebase(results, t_start),
                     truncated=scope.cancelled_caught,
                     client_cpu_s=time.process_time() - cpu_start)


def _last_end(results: list[RequestResult], t_start: float) -> float:
    ends = [r.start + r.e2e for r in results if r.e2e is not None]
    return (max(ends) - t_start) if ends else math.nan


def _rebase(results: list[RequestResult], t_start: float) -> list[RequestResult]:
    for r in results:
        r.start -= t_start
    return sorted(results, key=lambda r: r.index)
