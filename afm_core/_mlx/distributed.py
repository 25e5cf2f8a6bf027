"""The engine's batch generator for a model sharded over an ``mx.distributed`` group.

Under tensor or pipeline parallelism every rank holds a part of the model
and every forward pass contains collective operations (``all_sum`` after
each sharded layer, ``send``/``recv``/``all_gather`` between pipeline
stages), so every rank must run *the same* forward passes, in the same
order, on the same tokens.  Rank 0 (the leader) runs the engine; the other
ranks (followers) replay its batch operations (``afm_core._engine.distributed``).

Two things here make each rank's batch identical, step after step:

* **One sampled token per row, the leader's.**  Sampling is where the ranks
  could part: the leader applies each request's sampler, penalties and
  grammar mask; a follower has none of them.  :class:`ShardedGenerationBatch`
  samples on the leader as the engine's batch does, then shares the tokens
  with one ``all_sum`` (the followers add zeros), inside the step's lazy
  graph: no extra synchronisation, and every rank feeds the same tokens to
  the next step.  A follower's zeros are computed from its own logits
  (``argmax * 0``), so its whole forward pass, collectives included, is in
  the graph it evaluates.
* **The first token too.**  mlx-lm samples a row's first token when its
  prefill ends, in a plain ``GenerationBatch`` built by the prompt batch's
  ``generate`` (the leader with the request's sampler and processors, a
  follower greedily); :class:`ShardedPromptBatch` replaces that batch's
  sampled tokens with the leader's, shared the same way, before anything
  reads them.

:func:`sharded_generator` builds an ``EngineBatchGenerator`` (see
:mod:`.prefill`) with both.  Everything else about the batch (scheduling,
prefill chunking, stop tokens, ``max_tokens``) is mlx-lm's and deterministic,
so it is the same on every rank given the same inserts and removals.

May import: mlx, mlx-lm, the rest of ``afm_core._mlx``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from .batch import EngineGenerationBatch
from .prefill import EngineBatchGenerator, EnginePromptBatch

__all__ = ["ShardedGenerationBatch", "ShardedPromptBatch", "sharded_generator"]


def share(tokens: mx.array, group: Any, leader: bool) -> mx.array:
    """The leader's ``tokens`` on every rank: an ``all_sum`` to which the
    other ranks add zeros computed from their own ``tokens`` (so what produced
    them, the forward pass and its collectives, stays in their graph)."""
    return mx.distributed.all_sum(tokens if leader else tokens * 0, group=group)


class ShardedGenerationBatch(EngineGenerationBatch):
    """The engine's decode batch sampling on the leader only (see the module
    docstring).  Subclassed per generator by :func:`sharded_generator`, which
    sets the class attributes."""

    group: Any = None
    """The ``mx.distributed.Group`` the model is sharded over."""
    leader: bool = False
    """This rank samples (rank 0)."""

    def _sample(self, logprobs: mx.array) -> mx.array:
        if self.leader:
            return share(super()._sample(logprobs), self.group, True)
        return share(mx.argmax(logprobs, axis=-1), self.group, False)


class ShardedPromptBatch(EnginePromptBatch):
    """The engine's prompt batch whose rows' first tokens are the leader's.

    The batch of rows whose prefill ends, built by ``generate``, is mlx-lm's
    own ``GenerationBatch``: it samples each row's first token as soon as it
    is made (the leader with the requests' samplers and processors, a
    follower with none); that token, ``_next_tokens``, is replaced by the
    leader's before anything reads it."""

    group: Any = None
    leader: bool = False

    def generate(self, tokens: list[list[int]]) -> Any:
        batch = super().generate(tokens)
        if batch._next_tokens is not None:
            batch._next_tokens = share(batch._next_tokens, self.group, self.leader)
            mx.async_eval(batch._next_tokens)
        return batch


def sharded_generator(model: Any, *, group: Any, leader: bool, logprob_uids: set[int],
                      generator_class: type[EngineBatchGenerator] = EngineBatchGenerator,
                      shared: Callable[[Any], set[int]] | None = None, **kw: Any) -> EngineBatchGenerator:
    """An ``EngineBatchGenerator`` (or ``generator_class``, a subclass) whose
    batches sample on the leader and share the tokens over ``group``; ``kw``
    are ``generator_class``'s.  ``shared``, if given, makes the generator's
    ``shared`` set (called with the generator)."""
    where = {"group": group, "leader": leader}
    batch_class: type[ShardedGenerationBatch] = type("ShardedGenerationBatch", (ShardedGenerationBatch,), where)
    prompt_class = type("ShardedPromptBatch", (ShardedPromptBatch,), where)

    class _Sharded(generator_class):  # type: ignore[valid-type,misc]  # a class given at run time
        def _new_prompt_batch(self, uids: list[int], caches: list[list[Any]], **more: Any) -> EnginePromptBatch:
            batch = super()._new_prompt_batch(uids, caches, **more)
            # the same object as the engine's prompt batch, with ShardedPromptBatch's generate
            batch.__class__ = prompt_class
            return batch

    _Sharded.__name__ = _Sharded.__qualname__ = f"Sharded{generator_class.__name__}"
    gen = _Sharded(model, logprob_uids=logprob_uids, **kw)
    # the decode batch install() put in, swapped for the sharded one while empty
    batch = batch_class.empty(gen.model, gen.sampler)
    batch.logprob_uids = logprob_uids
    gen._generation_batch = batch
    if shared is not None:
        gen.shared = shared(gen)
        gen._prompt_batch = gen._new_prompt_batch([], [])  # empty still: the one holding the new set
    return gen
