"""One model over several hosts: rank 0 runs the engine, the other ranks follow.

A model sharded with MLX's own distributed layer (``mx.distributed``: tensor
parallelism with ``model.shard``, pipeline parallelism with
``model.model.pipeline``; see :mod:`afm_core._models.sharded`) has collective
operations inside every forward pass, so every rank must run the same
forward passes in the same order.  As in ``mlx_lm.server``, rank 0 runs
everything a single process runs (the HTTP server, the engine, its
generation thread with its :class:`~.worker.Worker`) and the other ranks run
a :class:`Follower`, which has a copy of the batch generator and nothing else.

**The journal.**  Rank 0's worker is a :class:`LeaderWorker`: its batch
generator (:class:`LeaderGenerator`) writes down every operation that changes
the batch (``insert``, ``remove``, ``forget`` a prompt's scores, ``share`` /
``unshare`` a prefill, ``save`` a finished row's cache in the prefix cache,
``reset_cache``) as a small JSON list.  Just before anything that runs the
model (an engine ``step``, an ``embed``), and on each idle heartbeat, rank 0
broadcasts the journal ending with that operation as one *frame*
(:class:`Channel`: an ``all_sum`` of a fixed 1 KiB head, plus one of the rest
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
:class:`Watchdog`: after ``DistributedConfig.timeout`` seconds on one
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

import copy
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import DistributedError
from .._mlx.prefill import EngineBatchGenerator
from .._stream.events import StreamFailure
from .commands import Delivery, Embed, Outputs
from .config import DistributedConfig, EngineConfig
from .worker import Worker

if TYPE_CHECKING:
    from mlx_lm.models.cache import LRUPromptCache

    from .._mlx.prefix_cache import PinningPromptCache
    from .._models.loader import ModelInfo

__all__ = [
    "Channel",
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

HEAD = 1024
"""Bytes of a frame's first broadcast (a longer frame takes a second one)."""
PREFIX_KEY = "model"
"""The follower's prefix-cache key (it serves one model)."""

Op = list[Any]
"""One journal entry: ``[name, *arguments]`` (see the module docstring)."""


# -- the group ---------------------------------------------------------------------


def init_group(backend: str = "any") -> Any:
    """This process's ``mx.distributed`` group, joined on the first call;
    :class:`DistributedError` when there is none of at least 2 ranks."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        raise DistributedError("this MLX build has no distributed back-end")
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        raise DistributedError(
            f"could not join the distributed group ({exc}); start every rank with mlx.launch "
            "(see docs/distributed.md), or set MLX_RANK and MLX_HOSTFILE on each") from exc
    if group.size() < 2:
        raise DistributedError("a distributed model needs at least 2 ranks; this group has 1")
    return group


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


def _lost(exc: BaseException) -> DistributedError:
    return DistributedError(f"lost the connection to another rank of the distributed group ({exc})")


# -- transport and watchdog -------------------------------------------------------------


class Channel:
    """Frames from rank 0 to every rank, as ``all_sum`` broadcasts on
    ``stream`` (the generation stream: MLX runs one stream's operations in
    order, so broadcasts and the model's collectives keep their order)."""

    def __init__(self, group: Any, stream: Any):
        import mlx.core as mx
        import numpy as np

        self.mx, self.np = mx, np
        self.group = group
        self.stream = stream

    def _sum(self, data: Any) -> Any:
        mx = self.mx
        out = mx.distributed.all_sum(mx.array(data), group=self.group, stream=self.stream)
        mx.eval(out)
        return out

    def send(self, payload: bytes) -> None:
        """Rank 0: broadcast ``payload``."""
        np = self.np
        head = np.zeros(HEAD, dtype=np.uint8)
        first = payload[: HEAD - 8]
        head[:8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
        head[8 : 8 + len(first)] = np.frombuffer(first, dtype=np.uint8)
        self._sum(head)
        if len(payload) > HEAD - 8:
            self._sum(np.frombuffer(payload[HEAD - 8 :], dtype=np.uint8))

    def recv(self) -> bytes:
        """Another rank: the payload rank 0 broadcasts."""
        np = self.np
        head = np.array(self._sum(np.zeros(HEAD, dtype=np.uint8)), copy=False)
        size = int.from_bytes(head[:8].tobytes(), "little")
        data = head[8 : 8 + min(size, HEAD - 8)].tobytes()
        if size > HEAD - 8:
            data += np.array(self._sum(np.zeros(size - (HEAD - 8), dtype=np.uint8))).tobytes()
        return data


class Watchdog:
    """Calls ``on_timeout(what, seconds)`` once, from its own thread, when one
    :meth:`guard` section has lasted ``timeout`` seconds."""

    def __init__(self, timeout: float, on_timeout: Callable[[str, float], None]):
        self.timeout = timeout
        self.on_timeout = on_timeout
        self.tripped = False
        self._what: str | None = None
        self._since = 0.0
        self._depth = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="afm-distributed-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Time the block (the outermost of nested ones)."""
        if self._depth == 0:
            self._what, self._since = what, time.monotonic()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._what = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        tick = min(0.25, self.timeout / 4)
        while not self._closed.wait(tick):
            what, since = self._what, self._since
            waited = time.monotonic() - since
            if what is not None and waited > self.timeout:
                self.tripped = True
                self.on_timeout(what, waited)
                return


class Link:
    """Rank 0's end: the journal of batch operations and the channel that
    broadcasts it (see the module docstring)."""

    def __init__(self, channel: Channel, watchdog: Watchdog, broken: Callable[[DistributedError], None]):
        self.channel = channel
        self.watchdog = watchdog
        self.broken = broken
        self.ops: list[Op] = []
        self.failed: DistributedError | None = None

    def record(self, op: Op) -> None:
        self.ops.append(op)

    def flush(self, last: Op | None, what: str) -> None:
        """Broadcast the journal, ending with ``last`` (which rank 0 runs next)."""
        if self.failed is not None:
            raise self.failed
        ops, self.ops = self.ops, []
        if last is not None:
            ops.append(last)
        payload = json.dumps(ops, separators=(",", ":")).encode()
        try:
            with self.watchdog.guard(what):
                self.channel.send(payload)
        except RuntimeError as exc:
            raise self.fail(_lost(exc)) from exc

    @contextmanager
    def running(self, what: str) -> Iterator[None]:
        """Run the block (model work with collectives) under the watchdog."""
        if self.failed is not None:
            raise self.failed
        try:
            with self.watchdog.guard(what):
                yield
        except RuntimeError as exc:
            raise self.fail(_lost(exc)) from exc

    def fail(self, err: DistributedError) -> DistributedError:
        if self.failed is None:
            self.failed = err
            self.broken(err)
        return self.failed


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


def generator_settings(*, max_batch: int, prefill_batch: int, prefill_step: int,
                       eos: list[int], stream: Any) -> dict[str, Any]:
    """``EngineBatchGenerator``'s arguments, as :meth:`Worker.setup` gives them."""
    return {
        "max_tokens": 1 << 30,
        "stop_tokens": [[t] for t in eos],
        "completion_batch_size": max_batch,
        "prefill_batch_size": min(prefill_batch, max_batch),
        "prefill_step_size": prefill_step,
        "stream": stream,
    }


def _config_digest(path: Path) -> str:
    try:
        return hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


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
                 "size": self.group.size(), "config": _config_digest(Path(self.model_key)),
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


# -- the other ranks ------------------------------------------------------------------


class DesyncError(DistributedError):
    """A follower's batch no longer matches rank 0's."""


class Follower:
    """Another rank's loop: apply rank 0's frames to a copy of its batch (see
    the module docstring).  :meth:`run` on the thread that owns MLX here."""

    def __init__(self, model: Any, *, group: Any, distributed: DistributedConfig, config_digest: str = ""):
        self.model = model
        self.config_digest = config_digest
        self.group = group
        self.distributed = distributed
        self.gen: EngineBatchGenerator | None = None
        self.prefix_cache: LRUPromptCache | None = None
        self.finished: dict[tuple[int, ...], list[Any]] = {}  # caches of the rows the last step ended
        self.copies: dict[int, list[Any]] = {}  # prefills copied for parked jobs in the last step
        self.steps = 0

    def run(self) -> int:
        """Follow until rank 0 stops (0) or the group breaks (1)."""
        import mlx.core as mx

        self.mx = mx
        self.stream = mx.new_stream(mx.default_device())
        channel = Channel(self.group, self.stream)
        watchdog = Watchdog(self.distributed.timeout, self._timed_out)
        try:
            while True:
                with watchdog.guard("waiting for rank 0"):
                    frame = channel.recv()
                ops: list[Op] = json.loads(frame)
                for op in ops:
                    with watchdog.guard(f"following rank 0's {op[0]}"):
                        if not self._apply(op):
                            log.info("rank 0 stopped: following ends after %d steps", self.steps)
                            return 0
        except RuntimeError as exc:
            log.error("%s", _lost(exc))
            return 1
        except DistributedError as exc:
            log.error("%s", exc)
            return 1
        finally:
            watchdog.close()
            if self.gen is not None:
                self.gen.close()

    def _timed_out(self, what: str, waited: float) -> None:
        log.error("rank 0 stopped answering (%s for %.0fs, timeout %gs): exiting",
                  what, waited, self.distributed.timeout)
        logging.shutdown()
        os._exit(1)

    def _apply(self, op: Op) -> bool:
        name = op[0]
        if name == "hello":
            self._hello(op[1])
            return True
        gen = self.gen
        if gen is None:
            raise DesyncError(f"rank 0 sent {name!r} before its hand-shake")
        if name == "step":
            self._step(gen)
        elif name == "insert":
            self._insert(gen, *op[1:])
        elif name == "remove":
            gen.remove(op[1])
        elif name == "forget":
            gen.forget_scores(op[1])
        elif name == "share":
            gen.shared.add(op[1])
        elif name == "unshare":
            gen.shared.discard(op[1])
        elif name == "save":
            self._save(op[1], op[2])
        elif name == "reset_cache":
            self.prefix_cache = self._new_prefix_cache()
        elif name == "embed":
            self._embed(op[1], op[2])
        elif name == "stop":
            return False
        else:
            raise DesyncError(f"unknown operation {name!r} from rank 0 (are all ranks the same afm version?)")
        return True

    def _hello(self, hello: dict[str, Any]) -> None:
        from .._mlx.distributed import sharded_generator

        mine = {"mode": self.distributed.mode, "size": self.group.size()}
        for key, value in mine.items():
            if hello.get(key) != value:
                raise DesyncError(f"rank 0 runs with {key}={hello.get(key)!r}, this rank with {value!r}")
        if self.config_digest and hello.get("config") and hello["config"] != self.config_digest:
            raise DesyncError("rank 0's model has another config.json than this rank's: "
                              "every rank must load the same model")
        self.prefix_cache_size = int(hello.get("prefix_cache_size", 256))
        self.prefix_cache = self._new_prefix_cache()
        self.gen = sharded_generator(
            self.model, group=self.group, leader=False, logprob_uids=set(),
            **generator_settings(max_batch=hello["max_batch"], prefill_batch=hello["prefill_batch"],
                                 prefill_step=hello["prefill_step"], eos=hello["eos"], stream=self.stream))

    def _new_prefix_cache(self) -> LRUPromptCache:
        from .._mlx.prefix_cache import make_prefix_cache

        # no byte budget: rank 0's evictions arrive with each "save"
        return make_prefix_cache(max_size=self.prefix_cache_size, max_bytes=1 << 62)

    def _step(self, gen: EngineBatchGenerator) -> None:
        self.finished.clear()
        self.copies.clear()
        _, responses = gen.next()
        self.steps += 1
        for r in responses:
            if r.finish_reason is not None and r.prompt_cache is not None and r.all_tokens is not None:
                self.finished[tuple(r.all_tokens)] = r.prompt_cache
        if gen.prefilled:
            self.copies = dict(gen.prefilled)
            gen.prefilled.clear()

    def _insert(self, gen: EngineBatchGenerator, uid: int, rest: list[int], all_tokens: list[int],
                source: Any, max_tokens: int, stop_at_eos: bool, top_k: int | None) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        from .._mlx.prefill import PromptScores

        whole = [*all_tokens, *rest]
        cache: list[Any] | None = None
        mine = whole
        if source == "prefix":
            assert self.prefix_cache is not None
            cache, mine = self.prefix_cache.fetch_nearest_cache(PREFIX_KEY, whole)
            if cache is not None and not mine:
                trim_prompt_cache(cache, 1)
                mine = whole[-1:]
            if cache is None:
                mine = whole
        elif isinstance(source, list) and source[0] == "shared":
            row = self.copies.get(source[1])
            if row is None:
                raise DesyncError(f"rank 0 starts a request from row {source[1]}'s prefill, which "
                                  "this rank did not copy")
            cache, mine = copy.deepcopy(row), whole[-1:]
        elif source is not None:
            raise DesyncError(f"unknown cache source {source!r} from rank 0")
        if len(mine) != len(rest):
            raise DesyncError(f"rank 0 prefills {len(rest)} tokens of a prompt, this rank's cache "
                              f"leaves {len(mine)}")
        scores = PromptScores(whole, top_k) if top_k is not None else None
        got = gen.insert_one(rest, max_tokens=max_tokens, cache=cache, all_tokens=all_tokens,
                             sampler=None, logits_processors=[], stop_at_eos=stop_at_eos, scores=scores)
        if got != uid:
            raise DesyncError(f"rank 0 inserted uid {uid}, this rank got {got}")

    def _save(self, tokens: list[int], keep: int) -> None:
        cache = self.finished.get(tuple(tokens))
        if cache is None or self.prefix_cache is None:
            raise DesyncError("rank 0 keeps the cache of a row this rank did not finish")
        self.mx.async_eval([c.state for c in cache])
        self.prefix_cache.insert_cache(PREFIX_KEY, list(tokens), cache)
        self.prefix_cache.trim_to(n_sequences=keep)
        if len(self.prefix_cache) != keep:
            raise DesyncError(f"rank 0's prefix cache holds {keep} entries, this rank's {len(self.prefix_cache)}")

    def _embed(self, lists: list[list[int]], pooling: str) -> None:
        from .._mlx.embeddings import embed

        try:
            with self.mx.stream(self.stream):
                embed(self.model, lists, pooling)
        except Exception as exc:  # noqa: BLE001 - rank 0 reports the same failure to its caller
            log.debug("embedding failed here too: %s", exc)


def run_follower(model: str | Path | None, config: EngineConfig | None = None) -> int:
    """Serve as one of the other ranks of a distributed model: load this
    rank's shard of ``model`` (as :func:`~afm_core.resolve_model` resolves it;
    every rank must resolve the same model) and follow rank 0's engine until
    it stops; blocks.  ``config`` is rank 0's (``config.distributed`` must be
    set).  Returns the process's exit status: 0 when rank 0 stopped, 1 when
    the group broke."""
    from .._mlx.fusion import fuse_for_cpu
    from .._models.resolve import resolve_model
    from .._models.sharded import load_sharded

    config = config or EngineConfig(distributed=DistributedConfig())
    distributed = config.distributed
    if distributed is None:
        raise ValueError("run_follower needs a config with a distributed setting")
    group = init_group(distributed.backend)
    if group.rank() == 0:
        raise DistributedError("rank 0 runs the engine (EngineConfig.distributed), not run_follower")
    path = resolve_model(model)
    log.info("rank %d of %d: loading %s (%s parallel)", group.rank(), group.size(), path, distributed.mode)
    loaded, _tokenizer, _info = load_sharded(path, distributed.mode, group)
    if config.cpu_fusion:
        fuse_for_cpu(loaded)
    follower = Follower(loaded, group=group, distributed=distributed, config_digest=_config_digest(path))
    log.info("rank %d of %d: following rank 0", group.rank(), group.size())
    return follower.run()
