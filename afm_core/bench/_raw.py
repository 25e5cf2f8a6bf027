"""The raw limit: the same jobs through mlx-lm's ``BatchGenerator`` in-process.

No HTTP, no detokenizer, no JSON: token ids in, token ids out, with the same
chat template, greedy sampling, stop tokens and ``max_tokens`` as the served
path.  ``RawRunner`` owns one dedicated thread (a parked generation thread,
see ``afm_core._engine.genthread``): MLX streams are thread-local, so the model is
loaded, the stream made and every step run on that thread; Trio only awaits
the result of a whole level.  Loops are bounded by their own deadline,
checked every step.

With ``kernels=True`` the model runs with the engine's CPU kernels
(``afm_core._mlx.fusion``; nothing changes on the GPU): the same model as the
served engine computes, so ours over that shows the server's own cost apart
from the kernels.
"""

from __future__ import annotations

import math
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import trio

from ._apis import prompt_text
from ._results import RequestResult, RunResult
from ._workload import Workload

T = TypeVar("T")


class RawRunner:
    """Loads ``model_dir`` on a dedicated thread and runs levels there."""

    def __init__(self, model_dir: str | Path, *, prefill_batch_size: int = 8,
                 kernels: bool = False, name: str = "raw", api: str = "chat") -> None:
        from afm_core._engine.genthread import run_on_generation_thread

        self.model_dir = str(model_dir)
        self.prefill_batch_size = prefill_batch_size
        self.kernels = kernels
        self.name = name
        self.api = api  # "completions": the prompt text raw; else the chat template
        self._model: Any = None
        self._tokenizer: Any = None
        self._stream: Any = None
        self._prompts: dict[int, list[int]] = {}
        self._inbox: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None]
        self._inbox = queue.SimpleQueue()
        self._thread = run_on_generation_thread(self._serve)

    def _serve(self) -> None:
        """The thread's loop: run calls in order until ``aclose``."""
        try:
            while (item := self._inbox.get()) is not None:
                fn, args, fut = item
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001  (handed to the caller)
                    fut.set_exception(exc)
        finally:
            if self._model is not None and self.kernels:
                from afm_core._mlx.fusion import unfuse_cpu_kernels

                unfuse_cpu_kernels(self._model)  # frees the kernels' traces from this thread's cache
            self._model = self._tokenizer = self._stream = None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        fut: Future[T] = Future()
        self._inbox.put((fn, args, fut))
        return await trio.to_thread.run_sync(fut.result)

    async def load(self) -> None:
        await self._call(self._load)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            self._inbox.put(None)
            await trio.to_thread.run_sync(self._thread.join)

    async def prompt_tokens(self, workload: Workload) -> list[int]:
        """Prompt length in tokens of every job (for cross-checks)."""
        return await self._call(lambda: [len(self._ids(workload, i))
                                         for i in range(len(workload.jobs))])

    async def run_closed(self, workload: Workload, concurrency: int, n_requests: int, *,
                         level_timeout: float, first_index: int = 0) -> RunResult:
        arrivals = [0.0] * n_requests
        return await self._call(self._loop, workload, concurrency, arrivals,
                                level_timeout, first_index, "closed", float(concurrency))

    async def run_open(self, workload: Workload, rate: float, schedule: Sequence[float], *,
                       level_timeout: float, first_index: int = 0) -> RunResult:
        return await self._call(self._loop, workload, 0, list(schedule), level_timeout,
                                first_index, "open", rate)

    # --- on the MLX thread -------------------------------------------------

    def _load(self) -> None:
        import mlx.core as mx
        from mlx_lm import load

        import afm_core  # noqa: F401  (registers the test architectures)

        # mlx-lm annotates a 2- or 3-tuple; without return_config it is always 2
        self._model, self._tokenizer = load(self.model_dir)  # type: ignore[misc]
        if self.kernels:
            from afm_core._mlx.fusion import fuse_for_cpu

            fuse_for_cpu(self._model)
        self._stream = mx.new_stream(mx.default_device())

    def _ids(self, workload: Workload, i: int) -> list[int]:
        job = workload.job(i)
        key = hash((workload.seed, len(workload.jobs), job.index))
        ids = self._prompts.get(key)
        if ids is None:
            if self.api == "completions":
                ids = list(self._tokenizer.encode(prompt_text(job)))
            else:
                ids = list(self._tokenizer.apply_chat_template(
                    [dict(m) for m in job.messages], add_generation_prompt=True, tokenize=True))
            self._prompts[key] = ids  # tokenized once (prompt_tokens), not per request
        return ids

    def _loop(self, workload: Workload, concurrency: int, arrivals: list[float],
              level_timeout: float, first_index: int, mode: str, level: float) -> RunResult:
        """Closed loop when ``concurrency > 0`` (arrivals ignored), else open
        loop admitting request k at ``arrivals[k]`` seconds."""
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        if self._model is None:
            raise RuntimeError("RawRunner.load() first")
        closed = concurrency > 0
        width = concurrency if closed else max(1, len(arrivals))
        stop_tokens = [[t] for t in sorted(self._tokenizer.eos_token_ids)]
        with mx.stream(self._stream):
            gen = BatchGenerator(
                self._model,
                stop_tokens=stop_tokens,
                completion_batch_size=width,
                prefill_batch_size=min(self.prefill_batch_size, width),
                stream=self._stream,
            )
        pending = deque(range(len(arrivals)))
        active: dict[int, tuple[RequestResult, list[float]]] = {}
        done: list[RequestResult] = []
        t_start = time.perf_counter()
        deadline = t_start + level_timeout
        truncated = False
        try:
            while pending or active:
                now = time.perf_counter()
                if now > deadline:
                    truncated = True
                    break
                while pending and (len(active) < concurrency if closed
                                   else t_start + arrivals[pending[0]] <= now):
                    k = pending.popleft()
                    i = first_index + k
                    t0 = now if closed else t_start + arrivals[k]
                    (uid,) = gen.insert([self._ids(workload, i)],
                                        max_tokens=[workload.job(i).max_tokens])
                    res = RequestResult(index=i, start=t0)
                    res.prompt_tokens = len(self._ids(workload, i))
                    active[uid] = (res, [])
                if not active:
                    time.sleep(max(0.0, min(t_start + arrivals[pending[0]], deadline)
                                   - time.perf_counter()))
                    continue
                _, responses = gen.next()
                now = time.perf_counter()
                for r in responses:
                    res, last = active[r.uid]
                    res.output_tokens += 1
                    if res.ttft is None:
                        res.ttft = now - res.start
                    else:
                        res.itls.append(now - last[0])
                    last[:] = [now]
                    if r.finish_reason is not None:
                        res.finish_reason = r.finish_reason
                        res.e2e = now - res.start
                        done.append(res)
                        del active[r.uid]
        finally:
            gen.close()
        for res, _ in active.values():
            res.error = "deadline"
            done.append(res)
        for k in pending:
            if truncated:
                done.append(RequestResult(index=first_index + k, error="deadline"))
        ends = [r.start + r.e2e for r in done if r.e2e is not None]
        duration = (max(ends) - t_start) if ends else math.nan
        for r in done:
            r.start = max(0.0, r.start - t_start) if r.start else 0.0
        done.sort(key=lambda r: r.index)
        return RunResult(self.name, mode, level, duration, done, truncated=truncated)
