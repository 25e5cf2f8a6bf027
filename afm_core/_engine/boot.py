"""Starting an engine: what its generation thread runs (load the model, build
the worker, report to Trio, run the worker's loop, undo the model's rewrites
when it ends), and the warm-up the Trio side runs once it started.

:class:`Boot` is started on a generation thread (:mod:`.genthread`) by
``Engine.run``, which waits for :attr:`Boot.ready` and then reads
:attr:`Boot.startup` (:mod:`.startup`: the worker, or why it could not start).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from .._errors import ModelLoadError
from .._mlx.malloc import trim
from .._stream.detok import DecoderTables
from .commands import Outputs
from .config import EngineConfig
from .startup import Started, StartFailed, StartUp

if TYPE_CHECKING:
    from ..api.completions_request import CompletionRequest
    from .worker import Worker

log = logging.getLogger("afm.engine")


class Boot:
    """The generation thread's body for one engine (call :meth:`run` there)."""

    def __init__(self, path: Path, config: EngineConfig, *, post: Callable[[Outputs], None],
                 token: trio.lowlevel.TrioToken):
        self.path = path
        self.config = config
        self.post = post
        self.token = token
        self.ready = trio.Event()
        """Set (in Trio) once :attr:`startup` is known."""
        self.startup: StartUp | None = None
        self._model: Any = None
        self._draft: Any = None

    def run(self) -> None:
        """Load and start; then the worker's loop until it stops (or dies)."""
        try:
            started = self._start()
        except BaseException as exc:  # noqa: BLE001 - reported to Engine.run
            self._undo_rewrites()
            self.startup = StartFailed(exc)
            self.token.run_sync_soon(self.ready.set)
            return
        self.startup = started
        self.token.run_sync_soon(self.ready.set)
        worker = started.worker
        try:
            worker.loop()
        except BaseException as exc:  # noqa: BLE001
            worker.fatal = exc
            worker.run_failed(exc)
        finally:
            self._undo_rewrites()

    def _start(self) -> Started:
        from .._mlx.fusion import fuse_for_cpu
        from . import distributed as _distributed

        config = self.config
        # the whole model, or (EngineConfig.distributed) rank 0's shard of it
        model, tokenizer, info = _distributed.load(self.path, config.distributed)
        self._model = model
        if config.cpu_fusion:
            fuse_for_cpu(model)
        adapters = None
        if config.adapters:  # after the CPU rewrite: they wrap its layers
            from .._mlx.lora import attach_adapters

            try:
                adapters = attach_adapters(model, config.adapters)
            except (ValueError, OSError) as exc:
                raise ModelLoadError(f"could not load the adapters: {exc}") from exc
        if config.draft_model is not None and config.spec_max_batch:
            self._draft = load_draft(config.draft_model, tokenizer, config.cpu_fusion)
        _size_buffer_cache(model)
        tables = DecoderTables.from_tokenizer(tokenizer)
        worker = _distributed.worker_factory(config.distributed)(
            model, tokenizer, post=self.post, config=config, model_key=str(self.path),
            adapters=adapters, draft=self._draft)
        worker.setup()
        trim()  # what loading freed (the tokenizer's parsed JSON) leaves the process
        return Started(worker, tokenizer, tables, info)

    def _undo_rewrites(self) -> None:
        """Undo the adapters and the CPU rewrite of what was loaded: the decode
        attention's name is patched module-wide, counted per model using it,
        and the kernels' traces in this thread's cache are freed."""
        from .._mlx.fusion import unfuse_cpu_kernels
        from .._mlx.lora import detach_adapters

        for loaded in (self._model, self._draft):
            if loaded is not None:
                detach_adapters(loaded)  # (before the rewrite it wraps is undone; none attached: nothing)
                unfuse_cpu_kernels(loaded)


def _size_buffer_cache(model: Any) -> None:
    """MLX's cache of freed buffers sized to the model
    (:func:`.kv_memory.buffer_cache_bytes`); process-wide, so the last
    engine started sets it."""
    import mlx.core as mx

    from .kv_memory import buffer_cache_bytes, param_bytes

    limit = buffer_cache_bytes(param_bytes(model))
    mx.set_cache_limit(limit)
    log.debug("MLX buffer cache limit: %d MiB", limit >> 20)


def load_draft(spec: str | Path, tokenizer: Any, fuse: bool) -> Any:
    """The draft model of speculative decoding (on the generation thread),
    fused like the model; its vocabulary must be the model's."""
    from .._mlx.fusion import fuse_for_cpu
    from .._models.loader import load
    from .._models.resolve import resolve_model

    draft, draft_tokenizer, _ = load(resolve_model(str(spec)))
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise ModelLoadError(f"the draft model {spec} has another vocabulary "
                             f"({draft_tokenizer.vocab_size} tokens, the model {tokenizer.vocab_size})")
    if fuse:
        fuse_for_cpu(draft)
    return draft


async def warm_up(complete: Callable[[CompletionRequest, str], Awaitable[None]], worker: Worker,
                  width: int) -> None:
    """Requests generating 2 to ``width + 1`` tokens together (``complete``)
    decode at every width from ``width`` down to 1; then the worker's counters
    and prefix cache are reset.  The requests are raw completions that ignore
    the end of text (no chat template needed, so a base model warms up too,
    and every width is reached); a model they fail on skips the rest, logged,
    and still serves."""
    from ..api.completions_request import CompletionRequest

    t0 = time.perf_counter()

    async def one(i: int) -> None:
        req = CompletionRequest.from_openai({"max_tokens": i + 2, "temperature": 0, "ignore_eos": True}, "Hello")
        await complete(req, f"afm-warmup-{i}")

    try:
        async with trio.open_nursery() as nursery:
            for i in range(width):
                nursery.start_soon(one, i)
    except Exception as exc:  # noqa: BLE001 - a model the warm-up fails on still serves
        while isinstance(exc, ExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]  # the first request's own error, not the nursery's wrapper
        log.warning("warm-up skipped: %s: %s", type(exc).__name__, exc)
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()
    worker.reset(lambda: token.run_sync_soon(done.set))
    await done.wait()
    log.info("warmed up in %.2fs (decode widths 1-%d)", time.perf_counter() - t0, width)
