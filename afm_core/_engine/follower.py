"""The other ranks of a distributed model: each follows rank 0's journal with
a copy of its batch generator (:class:`Follower`), started by
:func:`run_follower`.  See :mod:`.distributed`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import DistributedError
from .config import DistributedConfig, EngineConfig
from .dist_channel import (
    PREFIX_KEY,
    Channel,
    Op,
    Watchdog,
    config_digest,
    generator_settings,
    init_group,
    lost_connection,
)

if TYPE_CHECKING:
    from mlx_lm.models.cache import LRUPromptCache

    from .._mlx.prefill import EngineBatchGenerator

__all__ = ["DesyncError", "Follower", "run_follower"]

log = logging.getLogger("afm.distributed")


class DesyncError(DistributedError):
    """A follower's batch no longer matches rank 0's."""


class Follower:
    """Another rank's loop: apply rank 0's frames to a copy of its batch (see
    :mod:`.distributed`).  :meth:`run` on the thread that owns MLX here."""

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
            log.error("%s", lost_connection(exc))
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
    follower = Follower(loaded, group=group, distributed=distributed, config_digest=config_digest(path))
    log.info("rank %d of %d: following rank 0", group.rank(), group.size())
    return follower.run()
