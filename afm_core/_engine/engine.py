"""The Trio face of the engine.

    async with open_engine(model="path") as engine:
        async with engine.stream(request) as stream:
            async for event in stream: ...
        completion = await engine.complete(request)
        engine.cancel(request_id)
        engine.statistics()
        ids = await engine.tokenize("text"); text = await engine.detokenize(ids)
        result = await engine.embed(["text", [1, 2, 3]])   # L2-normalized vectors

``request`` is a :class:`ChatRequest` (messages through the chat template)
or a :class:`CompletionRequest` (a raw prompt, continued as is; its events are
the same kinds, and the prompt's own scores arrive as
``ChatStream.prompt_logprobs`` when it asks for them).

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
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from .._errors import (
    ContextLengthError,
    EngineBusyError,
    EngineClosedError,
    GenerationError,
    ModelLoadError,
    RequestError,
    UnsupportedError,
)
from .._mlx.tokenizer import encode
from .._models.loader import ModelInfo
from .._stream.detok import DecoderTables
from .._stream.events import Finish, Profile, Usage
from ..api.chat_request import ChatRequest
from ..api.completions_request import CompletionRequest
from .boot import Boot, warm_up
from .chat_stream import ChatStream, Embeddings
from .commands import Job, JobKey, RequestId, RequestRecord, RequestState
from .config import WARMUP_WIDTH, EngineConfig
from .genthread import Run, run_on_generation_thread
from .handoff import Handoff, embedding_answer
from .inflight import InFlight
from .lanes import Preparation, Ticket, text_cost
from .startup import Started, StartFailed
from .stats import WORKER_COUNTERS, EngineStatistics, WorkerStats
from .texts import (
    as_request,
    embedding_items,
    embedding_token_lists,
    request_cost,
    token_pieces,
    tokenizer_info,
)
from .worker import Worker

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

T = TypeVar("T")

log = logging.getLogger("afm.engine")


class Engine:
    """See the module docstring; make one with :func:`open_engine`."""

    def __init__(self, model: str | Path | None = None, *, config: EngineConfig | None = None,
                 **overrides: Any):
        self.config = replace(config or EngineConfig(), **overrides)
        self._model_spec = model
        self._requests = InFlight()  # see .commands for the id spaces
        self._embedding_calls = 0  # embed() calls running now (they count toward max_waiting)
        self._embedding_requests = 0  # embed() calls answered
        self._embedding_tokens = 0  # their input tokens
        self._requests_total = 0
        self._worker: Worker | None = None
        self._closed = True
        self._prep = Preparation(self.config.template_threads, timeout=self.config.prepare_timeout)
        self._side_calls = 0  # tokenize/detokenize calls running now (they count toward max_waiting)
        self.info: ModelInfo | None = None
        self._tokenizer: TokenizerWrapper | None = None
        self._detok_tables: DecoderTables | None = None
        self._embed_waits: set[trio.Event] = set()  # embed() calls waiting for the thread

    # -- lifecycle -------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._info().id

    @property
    def context_length(self) -> int:
        return self._info().context_length

    @property
    def adapters(self) -> tuple[str, ...]:
        """The names of the LoRA adapters served (``EngineConfig.adapters``), in order."""
        return tuple(name for name, _ in self.config.adapters)

    @property
    def model_path(self) -> Path:
        return self._info().path

    @property
    def healthy(self) -> bool:
        """Running, with a live generation thread."""
        return not self._closed and self._worker is not None and self._worker.fatal is None

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve (its generation thread's fatal error, or
        that it is not running); None while :attr:`healthy`."""
        if self._closed or self._worker is None:
            return "the engine is not running"
        fatal = self._worker.fatal
        return None if fatal is None else f"{type(fatal).__name__}: {fatal}"

    def _info(self) -> ModelInfo:
        if self.info is None:
            raise EngineClosedError("the engine is not running")
        return self.info

    async def run(self, *, task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, start the generation thread, serve until cancelled."""
        from .._models.resolve import resolve_model

        path = await trio.to_thread.run_sync(resolve_model, self._model_spec)
        token = trio.lowlevel.current_trio_token()
        boot = Boot(path, self.config, post=Handoff(token, self._requests.dispatch).post, token=token)
        thread = run_on_generation_thread(boot.run)
        started = await self._started(boot, thread)
        self._worker = started.worker
        self._tokenizer = started.tokenizer
        self._detok_tables = started.tables
        self.info = started.info
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
            for waiting in list(self._embed_waits):
                waiting.set()  # embed() finds no result: EngineClosedError

    @staticmethod
    async def _started(boot: Boot, thread: Run) -> Started:
        """Wait for the generation thread's start-up; a failed one (the thread
        has ended) raises :class:`ModelLoadError`, a cancelled wait stops the
        worker if it started."""
        try:
            await boot.ready.wait()
        except BaseException:
            with trio.CancelScope(shield=True):
                await boot.ready.wait()
                if isinstance(boot.startup, Started):
                    boot.startup.worker.stop()
                await trio.to_thread.run_sync(thread.join)
            raise
        if isinstance(boot.startup, Started):
            return boot.startup
        await trio.to_thread.run_sync(thread.join)
        assert isinstance(boot.startup, StartFailed)
        err = boot.startup.error
        if isinstance(err, ModelLoadError):
            raise err
        raise ModelLoadError(f"could not start the engine: {err}") from err

    # -- requests ----------------------------------------------------------------

    def stream(self, request: ChatRequest | CompletionRequest | dict[str, Any], *,
               request_id: RequestId | None = None, profile: str | None = None,
               group: RequestId | None = None, progress: bool = False,
               ) -> AbstractAsyncContextManager[ChatStream]:
        """Submit ``request``; raises before yielding when it cannot be served.

        ``request`` is a :class:`ChatRequest`, a :class:`CompletionRequest`
        or an OpenAI-style chat body (a dict, validated here with
        :meth:`ChatRequest.from_openai`, raising :class:`RequestError` as the
        HTTP layer's requests do).  Anything else raises :class:`TypeError`
        at the call.  ``group`` names another request id that cancels this
        request too (:meth:`cancel`): the several streams one client request
        runs (a completion with several prompts) share the client's id.

        ``progress`` True adds :class:`PromptProgress` events to the stream
        while its prompt is prefilled (llama.cpp's ``return_progress``): one
        when the generation thread starts the prompt (``processed`` equal to
        the cached tokens), one per prefill chunk of ``prefill_step`` tokens,
        and one with ``processed == total`` before the first token; False
        (the default) sends none.

        Streams opened together with the same prompt (the same token ids; not
        one scoring its prompt) share one prefill: the later ones wait for the
        first one's and start from a copy of its cache, computing only the
        last prompt token (their usage reports the rest as ``cached_tokens``).
        """
        return self._stream(as_request(request), request_id=request_id, profile=profile, group=group,
                            progress=progress)

    @asynccontextmanager
    async def _stream(self, request: ChatRequest | CompletionRequest, *, request_id: RequestId | None,
                      profile: str | None, group: RequestId | None = None,
                      progress: bool = False) -> AsyncIterator[ChatStream]:
        if self._closed or self._worker is None:
            raise EngineClosedError("the engine is not running")
        if self._worker.fatal is not None:
            raise EngineClosedError(f"the generation thread failed: {self._worker.fatal}")
        if profile not in (None, "basic", "extended"):
            raise RequestError("profile must be 'basic' or 'extended'", param="profile")
        request_id = request_id or f"req_{secrets.token_hex(12)}"
        self._requests.refuse_duplicate(request_id)
        self._check_room()
        record = self._requests.open(request_id, group)
        mailbox = record.mailbox
        try:
            job, downgraded = await self._prep.run(self._prepare, request, record, profile, progress,
                                                   cost=request_cost(request))
            self._requests_total += 1
            if record.state is RequestState.CANCELLED:
                record.state = RequestState.FINISHED
                mailbox.put((Finish("cancelled"), Usage(len(job.prompt), 0, 0)))
                mailbox.close()
            else:
                record.state = RequestState.SUBMITTED
                self._worker.submit(job)
            prefix = "cmpl" if isinstance(request, CompletionRequest) else "chatcmpl"
            yield ChatStream(
                id=f"{prefix}-{secrets.token_hex(12)}", created=int(time.time()),
                model=request.model or self.model_id, request_id=request_id, mailbox=mailbox,
                prompt_tokens=len(job.prompt), grammar_downgraded=downgraded, record=record,
            )
        finally:
            if record.on_thread and self._worker is not None:
                record.state = RequestState.DROPPED
                self._worker.drop(record.key)
            self._requests.close(record)
            mailbox.close()

    async def complete(self, request: ChatRequest | dict[str, Any], *, request_id: RequestId | None = None,
                       profile: str | None = None) -> dict[str, Any]:
        """The non-streaming response: the same path as :meth:`stream`, accumulated
        (a ``chat.completion``; a :class:`CompletionRequest`'s events are folded
        by :mod:`afm_core.api.completions` instead)."""
        if isinstance(request, CompletionRequest):
            raise TypeError("complete() builds a chat.completion; fold a CompletionRequest's stream "
                            "with afm_core.api.completions")
        async with self.stream(request, request_id=request_id, profile=profile) as s:
            return await s.collect()

    async def tokenize_chat(self, request: ChatRequest | CompletionRequest | dict[str, Any]) -> list[int]:
        """The prompt token ids ``request`` would be generated from: its messages
        (and tools) through the model's chat template, tokenized; what the
        ``count_tokens`` routes count.  Raises :class:`RequestError` as
        :meth:`stream` would for messages the template cannot render.  (A
        :class:`CompletionRequest` gives its raw prompt's ids.)"""
        req = as_request(request)
        if self._closed or self._tokenizer is None:
            raise EngineClosedError("the engine is not running")
        tokenizer, info = self._tokenizer, self._info()

        def run(ticket: Ticket) -> list[int]:
            from ..api.volatile import strip_volatile
            from .prepare import chat_prompt, completion_prompt

            if isinstance(req, CompletionRequest):
                return completion_prompt(req, tokenizer, info, check=ticket.check)
            chat = req if self.config.keep_volatile_lines else strip_volatile(req)
            return chat_prompt(chat, tokenizer, info, check=ticket.check)[0]

        return await self._side_call(run, cost=request_cost(req))

    async def tokenize(self, text: str, *, add_special_tokens: bool = False,
                       parse_special: bool = True) -> list[int]:
        """``text``'s token ids, as a raw prompt is tokenized: special-token
        spellings in ``text`` become their tokens unless ``parse_special`` is
        False; ``add_special_tokens`` adds what the tokenizer adds around a
        text (a BOS, for some models)."""
        tokenizer = self._running_tokenizer()

        def run(ticket: Ticket) -> list[int]:
            return encode(tokenizer, text, parse_special=parse_special,
                          add_special_tokens=add_special_tokens, check=ticket.check)

        return await self._side_call(run, cost=len(text))

    async def detokenize(self, ids: list[int]) -> str:
        """The text of token ids, special tokens spelled out; raises
        :class:`RequestError` for an id outside the vocabulary."""
        tokenizer = self._running_tokenizer()
        self._check_ids(ids)

        def run(ticket: Ticket) -> str:
            return str(tokenizer.decode(list(ids), skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False))

        return await self._side_call(run, cost=4 * len(ids))

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer as vLLM's ``GET /tokenizer_info`` describes it: its class,
        its special tokens (``bos_token``, ``eos_token``, ``pad_token``,
        ``unk_token``: text or None), the other plain settings it was loaded with
        (``add_bos_token``, ``clean_up_tokenization_spaces`` ...; no file paths),
        ``model_max_length`` (the context length served) and the chat template."""
        return tokenizer_info(self._running_tokenizer(), self._info())

    async def token_pieces(self, ids: list[int]) -> list[bytes]:
        """Each token's own bytes (a special token's spelling); raises
        :class:`RequestError` for an id outside the vocabulary.  A piece may
        be part of a UTF-8 character (byte-level and byte-fallback tokens)."""
        tokenizer = self._running_tokenizer()
        tables = self._detok_tables
        assert tables is not None
        self._check_ids(ids)

        def run(ticket: Ticket) -> list[bytes]:
            return token_pieces(ids, tokenizer, tables, ticket)

        return await self._side_call(run, cost=4 * len(ids))

    async def embed(self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]], *,
                    pooling: str | None = None) -> Embeddings:
        """One embedding per input: the model's final hidden states (after the
        final norm, before the LM head) pooled over the input's tokens and
        L2-normalized (see :attr:`EngineConfig.embedding_pooling`; ``pooling``
        overrides it for this call: ``mean``, ``last`` or ``cls``).

        ``inputs`` is a text, a list of token ids, or a list of texts and
        token-id lists.  Texts are tokenized as the tokenizer does by default
        (with what it adds around a text, such as a BOS).  The work runs on
        the generation thread, at most ``embedding_step`` tokens after each
        decode step (a long input in slices through a KV cache), so running
        streams pause at most that long between two tokens.  Raises :class:`RequestError` for an empty input or an
        id outside the vocabulary, :class:`ContextLengthError` for an input
        longer than the context, :class:`UnsupportedError` for a model without
        a transformer body (the echo test model), :class:`EngineBusyError` when
        ``max_batch + max_waiting`` requests (streams and embedding calls
        together) are already open.  Cancelling the caller is safe: work the
        thread has not started is skipped.
        """
        from .._mlx.embeddings import POOLINGS

        worker = self._worker
        if self._closed or worker is None or self._tokenizer is None:
            raise EngineClosedError("the engine is not running")
        if worker.fatal is not None:
            raise EngineClosedError(f"the generation thread failed: {worker.fatal}")
        pooling = pooling or self.config.embedding_pooling
        if pooling not in POOLINGS:
            raise RequestError(f"pooling must be one of {', '.join(POOLINGS)}", param="pooling")
        items = embedding_items(inputs)
        self._check_room()
        self._embedding_calls += 1
        try:
            result = await self._embed(worker, items, pooling)
        finally:
            self._embedding_calls -= 1
        self._embedding_requests += 1
        self._embedding_tokens += result.prompt_tokens
        return result

    async def _embed(self, worker: Worker, items: list[str | list[int]], pooling: str) -> Embeddings:
        from .._mlx.embeddings import NoHiddenStates

        tokenizer, info = self._tokenizer, self._info()
        assert tokenizer is not None
        limit = min(info.vocab_size, len(tokenizer))

        def tokenize(ticket: Ticket) -> list[tuple[int, ...]]:
            return embedding_token_lists(items, tokenizer, info, limit, ticket)

        token_lists = await self._prep.run(tokenize, cost=text_cost(items))
        if self._closed or worker.fatal is not None:
            raise EngineClosedError("the engine stopped before the embeddings were computed")
        result = await embedding_answer(worker, token_lists, pooling, self._embed_waits)
        if isinstance(result, NoHiddenStates):
            raise UnsupportedError(f"this model cannot compute embeddings: {result}", param="model")
        if isinstance(result, BaseException):
            raise GenerationError(f"computing the embeddings failed: {result}",
                                  code="embedding_failed") from result
        return Embeddings(result, tuple(len(t) for t in token_lists), pooling)

    def _running_tokenizer(self) -> TokenizerWrapper:
        if self._closed or self._tokenizer is None:
            raise EngineClosedError("the engine is not running")
        return self._tokenizer

    def _check_ids(self, ids: list[int]) -> None:
        assert self._tokenizer is not None
        limit = min(self._info().vocab_size, len(self._tokenizer))
        for n, i in enumerate(ids):
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < limit:
                raise RequestError(f"token id {i!r} is not in the model's vocabulary (0-{limit - 1})",
                                   param=f"tokens[{n}]")

    def cancel(self, request_id: RequestId) -> bool:
        """End an in-flight request with ``finish_reason: "cancelled"``, and
        every request opened with ``group=request_id``; False if none was."""
        def cancel_job(key: JobKey) -> None:
            if self._worker is not None:
                self._worker.cancel(key)

        return self._requests.cancel(request_id, cancel_job)

    # the registry's tables, by the names the engine had
    @property
    def _inflight(self) -> dict[RequestId, RequestRecord]:
        return self._requests.by_id

    @property
    def _by_key(self) -> dict[JobKey, RequestRecord]:
        return self._requests.by_key

    @property
    def _groups(self) -> dict[RequestId, set[RequestId]]:
        return self._requests.groups

    def statistics(self) -> EngineStatistics:
        w = self._worker
        ws = w.stats if w is not None else WorkerStats()  # not started: every counter 0
        return EngineStatistics(
            **{name: getattr(ws, name) for name in WORKER_COUNTERS},
            waiting=max(len(self._inflight) - ws.running, 0),
            requests_total=self._requests_total,
            requests_active=len(self._inflight),
            ttft_seconds_sum=self._requests.ttft_sum,
            ttft_count=self._requests.ttft_count,
            finished=dict(ws.finished),
            blas=w.blas if w is not None else "",
            embedding_requests=self._embedding_requests,
            embedding_tokens=self._embedding_tokens,
            embeddings_active=self._embedding_calls,
            prefix_cache_memory_misses=ws.prefix_cache_lookups - ws.prefix_cache_memory_hits,
            kv_bits=self.config.kv_bits,
            kv_group_size=self.config.kv_group_size if self.config.kv_bits is not None else None,
            preparations_abandoned=self._prep.abandoned,
            kv_cache=w.kv_description if w is not None and w.kv_half is not None else "",
            prefix_cache_budget=w.prefix_cache_bytes if w is not None else 0,
        )

    # -- internals -------------------------------------------------------------

    async def _warm_up(self) -> None:
        """See :attr:`EngineConfig.warmup` (:func:`.boot.warm_up`); then every counter starts from zero."""
        assert self._worker is not None

        async def complete(request: CompletionRequest, request_id: RequestId) -> None:
            async with self.stream(request, request_id=request_id) as s:
                async for _ in s:
                    pass

        await warm_up(complete, self._worker, min(WARMUP_WIDTH, self.config.max_batch))
        self._requests_total = 0
        self._requests.ttft_sum, self._requests.ttft_count = 0.0, 0

    def _prepare(self, ticket: Ticket, request: ChatRequest | CompletionRequest, record: RequestRecord,
                 profile: str | None, progress: bool = False) -> tuple[Job, bool]:
        """Template, tokenize and build the job (runs in a worker thread of :attr:`_prep`)."""
        from .prepare import build_job

        assert self._tokenizer is not None and self._detok_tables is not None
        return build_job(
            request, key=record.key, info=self._info(), tokenizer=self._tokenizer,
            tables=self._detok_tables, config=self.config, profile=profile, t_submit=record.t_submit,
            progress=progress, ticket=ticket,
        )

    def _check_room(self) -> None:
        """:class:`EngineBusyError` when ``max_batch + max_waiting`` requests (streams,
        embedding and tokenizing calls together) are already open."""
        busy = len(self._inflight) + self._embedding_calls + self._side_calls
        if busy >= self.config.max_batch + self.config.max_waiting:
            raise EngineBusyError(retry_after=1.0)

    async def _side_call(self, fn: Callable[[Ticket], T], *, cost: int) -> T:
        """``fn(ticket)`` in a preparation lane (:mod:`.lanes`), counted toward the
        queue limits as a request is (:class:`EngineBusyError` when full)."""
        self._check_room()
        self._side_calls += 1
        try:
            return await self._prep.run(fn, cost=cost)
        finally:
            self._side_calls -= 1




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


__all__ = ["ChatStream", "ContextLengthError", "Embeddings", "Engine", "EngineConfig",
           "EngineStatistics", "Profile", "open_engine"]
