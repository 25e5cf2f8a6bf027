"""One model over several hosts: rank 0 runs the engine, the other ranks follow.

A model sharded with MLX's own distributed layer (``mx.distributed``: tensor
parallelism with ``model.shard``, pipeline parallelism with
``model.model.pipeline``; see :mod:`afm_core._models.sharded`) has collective
operations inside every forward pass, so every rank must run the same
forward passes in the same order.  As in ``mlx_lm.server``, rank 0 runs
everything a single process runs (the HTTP server, the engine, its
generation thread with its :class:`~.worker.Worker`) and the other ranks run
a :class:`~.follower.Follower`, which has a copy of the batch generator and nothing else.

**The journal.**  Rank 0's worker is a :class:`LeaderWorker`: its batch
generator (:class:`LeaderGenerator`) writes down every operation that changes
the batch (``insert``, ``remove``, ``forget`` a prompt's scores, ``share`` /
``unshare`` a prefill, ``save`` a finished row's cache in the prefix cache,
``reset_cache``) as a small JSON list.  Just before anything that runs the
model (an engine ``step``, an ``embed``), and on each idle heartbeat, rank 0
broadcasts the journal ending with that operation as one *frame*
(:class:`~.dist_channel.Channel`: an ``all_sum`` of a fixed 1 KiB head, plus one of the rest
for a longer frame, the followers adding zeros, as ``mlx_lm.server`` shares a
request).  A follower applies each frame's operations to its own generator
and prefix cache, then runs the same step; the collectives of the two steps
meet.  Requests reach followers as token ids (an ``insert`` carries the
prompt, ``max_tokens``, ``stop_at_eos`` and where its cache comes from); no
sampler, penalty or grammar crosses: tokens are sampled on rank 0 only and
shared inside the step (:mod:`afm_core._mlx.distributed`), so what a
follower feeds the next step is rank 0's token whatever the request asked.
Cancel, drop, stop strings and ``max_tokens`` reach followers as
``remove``; a follower's own mlx-lm stop checks see the same tokens.

A follower checks what it can (its uids, the prefix lengths its caches give,
the model's config) and exits on a mismatch rather than compute garbage.

**Failure.**  A rank that dies closes its connections; the next collective
on the others raises ``[ring] connection to a peer was lost`` when it is the
only one pending, but with several collectives already queued (any forward
pass) MLX's evaluation can wait forever, as it does for a rank that hangs or
whose host is unreachable.  So every collective section runs under a
:class:`~.dist_channel.Watchdog`: after ``DistributedConfig.timeout`` seconds on one
section, rank 0 marks the engine failed (``worker.fatal``: ``/health``
503), ends every open stream with a ``distributed_failed`` error and, with
``exit_after``, ends the process; a follower exits.  A lost connection seen
directly fails the engine the same way at once.  The idle rank 0 broadcasts
an empty frame every ``heartbeat`` seconds, so a lost follower is noticed
without a request, and followers (whose watchdog covers their wait for the
next frame) notice a lost rank 0.

May import what :mod:`afm_core._engine` may.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import DistributedError
from .._mlx.prefill import EngineBatchGenerator
from .._stream.events import StreamFailure
from .commands import Delivery, Embed, Outputs
from .config import DistributedConfig, EngineConfig
from .dist_channel import (
    Channel,
    Link,
    Watchdog,
    config_digest,
    generator_settings,
    init_group,
)
from .follower import DesyncError, Follower, run_follower
from .worker import Worker

if TYPE_CHECKING:
    from .._mlx.prefix_cache import PinningPromptCache
    from .._models.loader import ModelInfo

__all__ = [
    "Channel",
    "DesyncError",
    "Follower",
    "LeaderGenerator",
    "LeaderWorker",
    "Watchdog",
    "init_distributed",
    "init_group",
    "load",
    "run_follower",
    "worker_factory",
]

log = logging.getLogger("afm.distributed")


def init_distributed(backend: str = "any") -> tuple[int, int]:
    """Join the distributed group (:func:`init_group`); ``(rank, size)``.
    Rank 0 runs the engine (``EngineConfig(distributed=...)``), every other
    rank :func:`run_follower`."""
    group = init_group(backend)
    return group.rank(), group.size()


def load(path: Path, distributed: DistributedConfig | None) -> tuple[Any, Any, ModelInfo]:
    """The engine's model loader: the whole model, or this rank's shard of it."""
    from .._models import loader

    if distributed is None:
        return loader.load(path)
    from .._models.sharded import load_sharded

    group = init_group(distributed.backend)
    if group.rank() != 0:
        raise DistributedError(f"rank {group.rank()} runs afm_core.run_follower; only rank 0 runs the engine")
    return load_sharded(path, distributed.mode, group)


def worker_factory(distributed: DistributedConfig | None) -> Callable[..., Worker]:
    """The engine's worker class: :class:`~.worker.Worker`, or with a
    distributed setting a :class:`LeaderWorker` bound to it."""
    if distributed is None:
        return Worker
    return partial(LeaderWorker, distributed=distributed)


# -- rank 0 ---------------------------------------------------------------------------


class JournaledSet(set[int]):
    """The generator's ``shared`` set: the worker's adds and discards are
    written down; the generator's own (inside a step or a removal, which every
    rank makes alike) are not."""

    def __init__(self, gen: LeaderGenerator):
        super().__init__()
        self.gen = gen

    def add(self, uid: int) -> None:
        if not self.gen.muted and uid not in self:
            self.gen.link.record(["share", uid])
        super().add(uid)

    def discard(self, uid: object) -> None:
        if not self.gen.muted and uid in self:
            self.gen.link.record(["unshare", uid])
        super().discard(uid)


class LeaderGenerator(EngineBatchGenerator):
    """Rank 0's batch generator: the engine's, writing every batch operation
    in ``link``'s journal and broadcasting it before each step."""

    def __init__(self, model: Any, *, link: Link, **kw: Any):
        self.link = link
        self.muted = 0
        self.prompts: dict[int, list[int]] = {}  # uid -> the whole prompt, until the row leaves
        self.last_prefilled: dict[int, list[int]] = {}  # rows whose prefill was copied in the last step
        super().__init__(model, **kw)

    def insert_one(self, prompt: list[int], *, max_tokens: int, cache: list[Any] | None,
                   all_tokens: list[int], sampler: Any, logits_processors: list[Any],
                   stop_at_eos: bool = True, scores: Any = None, adapter: int = 0) -> int:
        # (EngineConfig refuses adapters with distributed: ``adapter`` is always 0)
        uid = super().insert_one(prompt, max_tokens=max_tokens, cache=cache, all_tokens=all_tokens,
                                 sampler=sampler, logits_processors=logits_processors,
                                 stop_at_eos=stop_at_eos, scores=scores, adapter=adapter)
        whole = [*all_tokens, *prompt]
        self.prompts[uid] = whole
        source: Any = None
        if cache is not None:
            source = "prefix"
            if len(prompt) == 1:  # a parked job starting from the copy of its leader's prefill
                shared = next((u for u, p in self.last_prefilled.items() if p == whole), None)
                if shared is not None:
                    source = ["shared", shared]
        self.link.record(["insert", uid, list(prompt), list(all_tokens), source, max_tokens,
                          stop_at_eos, None if scores is None else scores.top_k])
        return uid

    def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
        uids = [int(u) for u in uids]
        self.muted += 1
        try:
            caches = super().remove(uids, return_prompt_caches)
        finally:
            self.muted -= 1
        self.link.record(["remove", uids])
        for uid in uids:
            self.prompts.pop(uid, None)
        return caches

    def forget_scores(self, uid: int) -> None:
        if uid in self.prompt_scores:
            self.link.record(["forget", uid])
        super().forget_scores(uid)

    def next(self) -> Any:
        self.link.flush(["step"], "an engine step's broadcast")
        self.muted += 1
        try:
            with self.link.running("an engine step"):
                prompt_responses, responses = super().next()
        finally:
            self.muted -= 1
        self.last_prefilled = {u: self.prompts[u] for u in self.prefilled if u in self.prompts}
        for r in responses:
            if r.finish_reason is not None:
                self.prompts.pop(r.uid, None)
        return prompt_responses, responses


class LeaderWorker(Worker):
    """Rank 0's generation-thread worker (see the module docstring): the
    engine's :class:`~.worker.Worker` with a :class:`LeaderGenerator`, a
    watchdog and an idle heartbeat."""

    def __init__(self, model: Any, tokenizer: Any, *, distributed: DistributedConfig, config: EngineConfig,
                 group: Any = None, **kw: Any):
        # (the probe of kv_dtype "auto" is one rank's forward pass: not with distributed)
        super().__init__(model, tokenizer, config=replace(config, kv_dtype="model"), **kw)
        self.distributed = distributed
        self.group = group
        self.link: Link | None = None
        self._closing = threading.Event()

    # -- set-up -------------------------------------------------------------------

    def setup(self) -> None:
        from .._mlx.distributed import sharded_generator

        if self.group is None:
            self.group = init_group(self.distributed.backend)
        super().setup()
        if self.link is not None:  # (only _reset_generator calls it again, and that one raises)
            return
        self.gen.close()
        watchdog = Watchdog(self.distributed.timeout, self._timed_out)
        self.link = link = Link(Channel(self.group, self.stream), watchdog, self._broken)
        eos = sorted(self.tokenizer.eos_token_ids)
        self.gen = sharded_generator(
            self.model, group=self.group, leader=True, logprob_uids=self.logprob_uids,
            generator_class=LeaderGenerator, link=link, shared=JournaledSet,
            **generator_settings(max_batch=self.config.max_batch, prefill_batch=self.config.prefill_batch,
                                 prefill_step=self.config.prefill_step, eos=eos, stream=self.stream))
        hello = {"max_batch": self.config.max_batch, "prefill_batch": self.config.prefill_batch,
                 "prefill_step": self.config.prefill_step, "eos": eos, "mode": self.distributed.mode,
                 "size": self.group.size(), "config": config_digest(Path(self.model_key)),
                 "prefix_cache_size": self.prefix_cache.max_size}
        link.flush(["hello", hello], "the start-up hand-shake")
        threading.Thread(target=self._heartbeat, name="afm-distributed-heartbeat", daemon=True).start()

    def _new_prefix_cache(self) -> PinningPromptCache:
        if self.link is not None:
            self.link.record(["reset_cache"])
        return super()._new_prefix_cache()

    # -- what the journal needs beside the generator's operations -----------------

    def _save_cache(self, tokens: list[int], cache: list[Any], adapter: int = 0,
                    pins: tuple[tuple[int, float], ...] = ()) -> None:
        # no pins: the other ranks replay rank 0's evictions by their own LRU order
        super()._save_cache(tokens, cache, adapter)
        assert self.link is not None
        self.link.record(["save", list(tokens), len(self.prefix_cache)])

    def _keep_prefix(self, job: Any) -> None:
        # A cancelled or dropped row's cache is not kept across ranks: the
        # followers save only rows they finished themselves (``Follower._save``).
        return

    def _embed(self, cmd: Embed) -> None:
        from .._mlx.embeddings import embed

        if cmd.abandoned.is_set():
            return
        assert self.link is not None
        lists = [list(t) for t in cmd.token_lists]
        self.link.flush(["embed", lists, cmd.pooling], "an embedding's broadcast")
        result: list[list[float]] | BaseException
        try:
            with self.link.running("an embedding"), self.mx.stream(self.stream):
                result = embed(self.model, cmd.token_lists, cmd.pooling)
        except DistributedError as exc:
            cmd.done(exc)
            raise
        except Exception as exc:  # noqa: BLE001 - the caller's error, not the thread's
            result = exc
        cmd.done(result)

    def _reset_generator(self) -> None:
        # a failed step leaves the ranks at different points of it: the group cannot go on
        assert self.link is not None
        raise self.link.fail(self.link.failed or DistributedError(
            "an engine step failed on rank 0; the ranks of the distributed group are out of step"))

    def _shutdown(self, outputs: Outputs) -> None:
        self._closing.set()
        super()._shutdown(outputs)
        assert self.link is not None
        try:
            self.link.flush(["stop"], "the shutdown's broadcast")
        except DistributedError as exc:
            log.warning("could not tell the other ranks to stop: %s", exc)
        self.link.watchdog.close()

    # -- failure -------------------------------------------------------------------

    def _heartbeat(self) -> None:
        while not self._closing.wait(self.distributed.heartbeat):
            if self.fatal is not None or (self.link is not None and self.link.failed is not None):
                return
            if not self.by_key:
                self.sync(self._beat)

    def _beat(self) -> None:  # on the generation thread
        if self.link is not None and self.link.failed is None and not self._closing.is_set():
            self.link.flush(None, "a heartbeat")

    def _timed_out(self, what: str, waited: float) -> None:  # on the watchdog's thread
        assert self.link is not None
        self.link.fail(DistributedError(
            f"the distributed group stopped answering: {what} waited {waited:.0f}s for another rank "
            f"(timeout {self.distributed.timeout:g}s); a rank is hung, dead or unreachable"))

    def _broken(self, err: DistributedError) -> None:
        """The group is gone: fail the engine and every open stream now (from
        whichever thread saw it), then end the process if so configured."""
        log.error("%s", err)
        if self.fatal is None:
            self.fatal = err
        failure = StreamFailure(f"generation failed: {err}", code=err.code)
        for _ in range(3):  # the generation thread may still be changing by_key
            try:
                keys = list(self.by_key)
                break
            except RuntimeError:
                continue
        else:
            keys = []
        outputs: Outputs = {key: Delivery((failure,), True) for key in keys}
        if outputs:
            self.post(outputs)
        if self.distributed.exit_after is not None:
            threading.Thread(target=_exit_later, args=(self.distributed.exit_after, str(err)),
                             name="afm-distributed-exit", daemon=True).start()


def _exit_later(seconds: float, why: str) -> None:
    time.sleep(seconds)
    log.error("ending the process: %s", why)
    logging.shutdown()
    os._exit(1)


