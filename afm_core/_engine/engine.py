"""The Trio face of the engine.

    async with open_engine(model="path") as engine:
        async with engine.stream(request) as stream:
            async for event in stream: ...
        completion = await engine.complete(request)
        engine.cancel(request_id)
        engine.statistics()

One generation thread (:mod:`afm_core._engine.worker`) owns MLX; Trio tasks submit
jobs and receive one batch of events per engine step.  Templating and
tokenization run in Trio worker threads so they never stall the batch.
Cancellation is Trio's: leaving ``engine.stream(...)`` early (a cancelled
scope, ``move_on_after``, a ``break``) drops the request from the batch at
the next step; ``engine.cancel(id)`` ends it cleanly with ``cancelled``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from .._errors import (
    ContextLengthError,
    DuplicateRequestError,
    EngineBusyError,
    EngineClosedError,
    GenerationError,
    ModelLoadError,
    RequestError,
    StreamErrorChunk,
)
from .._models.loader import ModelInfo
from .._stream.detok import DecoderTables
from .._stream.events import Event, Finish, Profile, StreamFailure, Usage
from .._stream.request import ChatRequest
from .commands import (
    Job,
    JobKey,
    Outputs,
    RequestId,
    RequestRecord,
    RequestState,
    Started,
    StartFailed,
    StartUp,
)
from .config import WARMUP_WIDTH, EngineConfig
from .genthread import run_on_generation_thread
from .mailbox import Mailbox
from .worker import Worker

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

TERMINAL = (Finish, StreamFailure)

log = logging.getLogger("afm.engine")


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of the engine (see :meth:`Engine.statistics`)."""

    running: int
    waiting: int
    requests_total: int
    requests_active: int
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    prefix_cache_hits: int
    prefix_cache_lookups: int
    prefix_cache_bytes: int
    steps: int
    ttft_seconds_sum: float
    ttft_count: int
    finished: dict[str, int] = field(default_factory=dict)
    blas: str = ""
    """The BLAS computing MLX's CPU products (``openblas``, ``reference``,
    ``accelerate``; see ``afm_core._mlx.blas``), once the engine has started."""


class ChatStream:
    """One request's events; iterate it, or ``batches()`` for one tuple per step."""

    def __init__(self, *, id: str, created: int, model: str, request_id: RequestId,
                 mailbox: Mailbox, prompt_tokens: int, grammar_downgraded: bool):
        self.id = id
        self.created = created
        self.model = model
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.grammar_downgraded = grammar_downgraded
        self._mailbox = mailbox

    @property
    def finished(self) -> bool:
        """True once every event of the stream has arrived: reading will not wait."""
        return self._mailbox.closed

    async def batches(self) -> AsyncIterator[tuple[Event, ...]]:
        """Everything that arrived since the last batch (one engine step, or
        several when the reader fell behind), until the stream ends."""
        while (batch := await self._mailbox.take()) is not None:
            yield batch
            if any(isinstance(e, TERMINAL) for e in batch):
                # Usage/Profile ride in the same batch as Finish
                return

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for batch in self.batches():
            for event in batch:
                yield event

    async def collect(self) -> dict[str, Any]:
        """The whole stream as a ``chat.completion`` dict (the non-streaming shape)."""
        from .._stream.accumulate import ChunkAccumulator
        from .._stream.sse import SSEEncoder

        enc = SSEEncoder(self.id, self.created, self.model)
        acc = ChunkAccumulator()
        try:
            async for batch in self.batches():
                for chunk in enc.chunks(batch):
                    acc.feed_chunk(chunk)
            acc.feed_done()
        except StreamErrorChunk as exc:
            raise GenerationError(exc.message, code=exc.code) from None
        result = acc.result()
        for choice in result["choices"]:
            message = choice["message"]
            if message["content"] is None and not message.get("tool_calls"):
                message["content"] = ""  # an empty answer is "", as OpenAI's; null only beside tool calls
        return result


class Engine:
    """See the module docstring; make one with :func:`open_engine`."""

    def __init__(self, model: str | Path | None = None, *, config: EngineConfig | None = None,
                 **overrides: Any):
        self.config = replace(config or EngineConfig(), **overrides)
        self._model_spec = model
        self._inflight: dict[RequestId, RequestRecord] = {}  # see .commands for the id spaces
        self._by_key: dict[JobKey, RequestRecord] = {}
        self._serial = 0  # the last JobKey given
        self._requests_total = 0
        self._ttft_sum = 0.0
        self._ttft_count = 0
        self._worker: Worker | None = None
        self._closed = True
        self._limiter = trio.CapacityLimiter(self.config.template_threads)
        self.info: ModelInfo | None = None
        self._tokenizer: TokenizerWrapper | None = None
        self._detok_tables: DecoderTables | None = None

    # -- lifecycle -------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._info().id

    @property
    def context_length(self) -> int:
        return self._info().context_length

    @property
    def model_path(self) -> Path:
        return self._info().path

    @property
    def healthy(self) -> bool:
        """Running, with a live generation thread."""
        return not self._closed and self._worker is not None and self._worker.fatal is None

    def _info(self) -> ModelInfo:
        if self.info is None:
            raise EngineClosedError("the engine is not running")
        return self.info

    async def run(self, *, task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, start the generation thread, serve until cancelled."""
        from .._models.resolve import resolve_model

        path = await trio.to_thread.run_sync(resolve_model, self._model_spec)
        token = trio.lowlevel.current_trio_token()
        ready = trio.Event()
        startup: StartUp | None = None  # set by the thread before ``ready``

        # Hand-off: the thread appends each step's outputs; one Trio callback is
        # scheduled at a time and drains everything posted since, so a busy Trio
        # side gets one wake-up per drain (each stream's mailbox coalesces).
        lock = threading.Lock()
        pending: list[Outputs] = []
        scheduled = False

        def drain() -> None:
            nonlocal scheduled
            with lock:
                batch = pending[:]
                pending.clear()
                scheduled = False
            for outputs in batch:
                self._dispatch(outputs)

        def post(outputs: Outputs) -> None:
            nonlocal scheduled
            with lock:
                pending.append(outputs)
                if scheduled:
                    return
                scheduled = True
            try:
                token.run_sync_soon(drain)
            except trio.RunFinishedError:
                pass

        def thread_main() -> None:
            from .._mlx.fusion import fuse_for_cpu, unfuse_cpu_kernels
            from .._models import loader as _loader

            nonlocal startup
            try:
                model, tokenizer, info = _loader.load(path)
                if self.config.cpu_fusion:
                    fuse_for_cpu(model)
                tables = DecoderTables.from_tokenizer(tokenizer)
                worker = Worker(
                    model, tokenizer, post=post, max_batch=self.config.max_batch,
                    prefill_batch=self.config.prefill_batch, prefill_step=self.config.prefill_step,
                    prefix_cache_bytes=self.config.prefix_cache_bytes, model_key=str(path),
                )
                worker.setup()
                startup = Started(worker, tokenizer, tables, info)
            except BaseException as exc:  # noqa: BLE001 - reported to run()
                startup = StartFailed(exc)
                token.run_sync_soon(ready.set)
                return
            token.run_sync_soon(ready.set)
            try:
                worker.loop()
            except BaseException as exc:  # noqa: BLE001
                worker.fatal = exc
                worker.run_failed(exc)
            finally:
                unfuse_cpu_kernels(model)  # frees the kernels' traces from this thread's cache

        thread = run_on_generation_thread(thread_main)
        try:
            await ready.wait()
        except BaseException:
            with trio.CancelScope(shield=True):
                await ready.wait()
                if isinstance(startup, Started):
                    startup.worker.stop()
                await trio.to_thread.run_sync(thread.join)
            raise
        if not isinstance(startup, Started):
            await trio.to_thread.run_sync(thread.join)
            assert isinstance(startup, StartFailed)
            err = startup.error
            if isinstance(err, ModelLoadError):
                raise err
            raise ModelLoadError(f"could not start the engine: {err}") from err
        self._worker = startup.worker
        self._tokenizer = startup.tokenizer
        self._detok_tables = startup.tables
        self.info = startup.info
        self._closed = False
        if self.config.warmup:
            await self._warm_up()
        task_status.started(self)
        try:
            await trio.sleep_forever()
        finally:
            self._closed = True
            with trio.CancelScope(shield=True):
                self._worker.stop()
                await trio.to_thread.run_sync(thread.join)
            for record in list(self._inflight.values()):
                record.mailbox.close()

    # -- requests ----------------------------------------------------------------

    def stream(self, request: ChatRequest | dict[str, Any], *, request_id: RequestId | None = None,
               profile: str | None = None) -> AbstractAsyncContextManager[ChatStream]:
        """Submit ``request``; raises before yielding when it cannot be served.

        ``request`` is a :class:`ChatRequest` or an OpenAI-style body (a dict,
        validated here with :meth:`ChatRequest.from_openai`, raising
        :class:`RequestError` as the HTTP layer's requests do).  Anything else
        raises :class:`TypeError` at the call.
        """
        return self._stream(_as_request(request), request_id=request_id, profile=profile)

    @asynccontextmanager
    async def _stream(self, request: ChatRequest, *, request_id: RequestId | None,
                      profile: str | None) -> AsyncIterator[ChatStream]:
        if self._closed or self._worker is None:
            raise EngineClosedError("the engine is not running")
        if self._worker.fatal is not None:
            raise EngineClosedError(f"the generation thread failed: {self._worker.fatal}")
        if profile not in (None, "basic", "extended"):
            raise RequestError("profile must be 'basic' or 'extended'", param="profile")
        request_id = request_id or f"req_{secrets.token_hex(12)}"
        if request_id in self._inflight:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        if len(self._inflight) >= self.config.max_batch + self.config.max_waiting:
            raise EngineBusyError(retry_after=1.0)
        mailbox = Mailbox()
        self._serial += 1
        record = RequestRecord(request_id, JobKey(self._serial), mailbox, time.perf_counter())
        self._inflight[request_id] = record
        self._by_key[record.key] = record
        try:
            job, downgraded = await trio.to_thread.run_sync(
                self._prepare, request, record, profile, limiter=self._limiter, abandon_on_cancel=True
            )
            self._requests_total += 1
            if record.state is RequestState.CANCELLED:
                record.state = RequestState.FINISHED
                mailbox.put((Finish("cancelled"), Usage(len(job.prompt), 0, 0)))
                mailbox.close()
            else:
                record.state = RequestState.SUBMITTED
                self._worker.submit(job)
            yield ChatStream(
                id=f"chatcmpl-{secrets.token_hex(12)}", created=int(time.time()),
                model=request.model or self.model_id, request_id=request_id, mailbox=mailbox,
                prompt_tokens=len(job.prompt), grammar_downgraded=downgraded,
            )
        finally:
            if record.on_thread and self._worker is not None:
                record.state = RequestState.DROPPED
                self._worker.drop(record.key)
            self._inflight.pop(request_id, None)
            self._by_key.pop(record.key, None)
            mailbox.close()

    async def complete(self, request: ChatRequest | dict[str, Any], *, request_id: RequestId | None = None,
                       profile: str | None = None) -> dict[str, Any]:
        """The non-streaming response: the same path as :meth:`stream`, accumulated."""
        async with self.stream(request, request_id=request_id, profile=profile) as s:
            return await s.collect()

    async def tokenize_chat(self, request: ChatRequest | dict[str, Any]) -> list[int]:
        """The prompt token ids ``request`` would be generated from: its messages
        (and tools) through the model's chat template, tokenized; what the
        ``count_tokens`` routes count.  Raises :class:`RequestError` as
        :meth:`stream` would for messages the template cannot render."""
        req = _as_request(request)
        if self._closed or self._tokenizer is None:
            raise EngineClosedError("the engine is not running")
        tokenizer, info = self._tokenizer, self._info()

        def run() -> list[int]:
            from .prepare import render_prompt

            return list(tokenizer.encode(render_prompt(req, tokenizer, info),
                                         add_special_tokens=False))

        return await trio.to_thread.run_sync(run, limiter=self._limiter, abandon_on_cancel=True)

    def cancel(self, request_id: RequestId) -> bool:
        """End an in-flight request with ``finish_reason: "cancelled"``; False if unknown."""
        record = self._inflight.get(request_id)
        if record is None:
            return False
        if record.state is RequestState.PREPARING:
            record.state = RequestState.CANCELLED  # ends once preparation returns
        elif record.state is RequestState.SUBMITTED:
            record.state = RequestState.CANCELLING
            if self._worker is not None:
                self._worker.cancel(record.key)
        else:
            return False  # already cancelled, finished or dropped
        return True

    def statistics(self) -> EngineStatistics:
        w = self._worker
        ws = w.stats if w is not None else None
        running = ws.running if ws else 0
        return EngineStatistics(
            running=running,
            waiting=max(len(self._inflight) - running, 0),
            requests_total=self._requests_total,
            requests_active=len(self._inflight),
            prompt_tokens=ws.prompt_tokens if ws else 0,
            cached_tokens=ws.cached_tokens if ws else 0,
            generation_tokens=ws.generation_tokens if ws else 0,
            prefix_cache_hits=ws.prefix_cache_hits if ws else 0,
            prefix_cache_lookups=ws.prefix_cache_lookups if ws else 0,
            prefix_cache_bytes=ws.prefix_cache_bytes if ws else 0,
            steps=ws.steps if ws else 0,
            ttft_seconds_sum=self._ttft_sum,
            ttft_count=self._ttft_count,
            finished=dict(ws.finished) if ws else {},
            blas=w.blas if w is not None else "",
        )

    # -- internals -------------------------------------------------------------

    async def _warm_up(self) -> None:
        """See :attr:`EngineConfig.warmup`: requests generating 2 to
        ``width + 1`` tokens together decode at every width from ``width``
        down to 1; then every counter starts from zero."""
        width = min(WARMUP_WIDTH, self.config.max_batch)
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            req = ChatRequest.from_openai({"messages": [{"role": "user", "content": "Hello"}],
                                           "max_tokens": i + 2, "temperature": 0})
            await self.complete(req, request_id=f"afm-warmup-{i}")

        try:
            async with trio.open_nursery() as nursery:
                for i in range(width):
                    nursery.start_soon(one, i)
        except Exception as exc:  # noqa: BLE001 - a model that cannot chat still serves
            log.warning("warm-up skipped: %s", exc)
        assert self._worker is not None
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()
        self._worker.reset(lambda: token.run_sync_soon(done.set))
        await done.wait()
        self._requests_total = 0
        self._ttft_sum, self._ttft_count = 0.0, 0
        log.info("warmed up in %.2fs (decode widths 1-%d)", time.perf_counter() - t0, width)

    def _dispatch(self, outputs: Outputs) -> None:
        """Runs in Trio: deliver one engine step's events."""
        now = time.perf_counter()
        for key, (events, finished) in outputs.items():
            record = self._by_key.get(key)
            if record is None:
                continue
            if record.t_first is None:
                record.t_first = now
                self._ttft_sum += now - record.t_submit
                self._ttft_count += 1
            record.mailbox.put(events)
            if finished:
                record.state = RequestState.FINISHED
                record.mailbox.close()  # the reader drains what is there, then sees the end

    def _prepare(self, request: ChatRequest, record: RequestRecord, profile: str | None) -> tuple[Job, bool]:
        """Template, tokenize and build the job (runs in a worker thread)."""
        from .prepare import build_job

        assert self._tokenizer is not None and self._detok_tables is not None
        return build_job(
            request, key=record.key, info=self._info(), tokenizer=self._tokenizer,
            tables=self._detok_tables, config=self.config, profile=profile, t_submit=record.t_submit,
        )


def _as_request(request: object) -> ChatRequest:
    """``request`` as a :class:`ChatRequest`: an OpenAI-style dict is validated
    (:class:`RequestError` when it is not a valid body)."""
    if isinstance(request, ChatRequest):
        return request
    if isinstance(request, dict):
        return ChatRequest.from_openai(request)
    raise TypeError(f"request must be a ChatRequest or an OpenAI-style dict, not {type(request).__name__}")


@asynccontextmanager
async def open_engine(model: str | Path | None = None, *, config: EngineConfig | None = None,
                      **overrides: Any) -> AsyncIterator[Engine]:
    """Start an engine for ``model`` (path, .gguf, hub id, or None for the default)."""
    engine = Engine(model, config=config, **overrides)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()


__all__ = ["ChatStream", "ContextLengthError", "Engine", "EngineConfig", "EngineStatistics",
           "Profile", "open_engine"]
