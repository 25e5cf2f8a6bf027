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
* **Every sampling goes through that batch.**  mlx-lm samples a row's first
  token when its prefill ends, in a plain ``GenerationBatch`` built by the
  prompt batch's ``generate``; :class:`ShardedPromptBatch` builds the sharded
  batch there instead.

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
from mlx_lm.generate import _merge_caches

from .batch import EngineGenerationBatch
from .prefill import EngineBatchGenerator, EnginePromptBatch

__all__ = ["ShardedGenerationBatch", "ShardedPromptBatch", "sharded_generator"]


class ShardedGenerationBatch(EngineGenerationBatch):
    """The engine's decode batch sampling on the leader only (see the module
    docstring).  Subclassed per generator by :func:`sharded_generator`, which
    sets the three class attributes (mlx-lm steps a new batch inside its
    ``__init__``, before an instance attribute could be set)."""

    group: Any = None
    """The ``mx.distributed.Group`` the model is sharded over."""
    leader: bool = False
    """This rank samples (rank 0)."""
    shared_logprob_uids: set[int] = set()
    """The generator's ``logprob_uids``, for the batches the prompt batch builds."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.logprob_uids = self.shared_logprob_uids
        super().__init__(*args, **kw)

    def _sample(self, logprobs: mx.array) -> mx.array:
        if self.leader:
            mine = super()._sample(logprobs)
        else:
            mine = mx.argmax(logprobs, axis=-1) * 0
        return mx.distributed.all_sum(mine, group=self.group)


class ShardedPromptBatch(EnginePromptBatch):
    """The engine's prompt batch handing its rows to a :class:`ShardedGenerationBatch`."""

    batch_class: type[ShardedGenerationBatch] = ShardedGenerationBatch

    def generate(self, tokens: list[list[int]]) -> ShardedGenerationBatch:
        """``EnginePromptBatch.generate`` with the sharded batch class (the first
        token of each row is sampled there)."""
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        batch = self.batch_class(
            self.model,
            self.uids,
            mx.array([t[-1] for t in tokens]),
            _merge_caches(self.rows),
            self.tokens,
            self.samplers,
            self.fallback_sampler,
            self.logits_processors,
            self.stop_sequences,
            self.max_tokens,
        )
        self.uids, self.rows, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens, self.stop_sequences = [], [], [], []
        return batch


def sharded_generator(model: Any, *, group: Any, leader: bool, logprob_uids: set[int],
                      generator_class: type[EngineBatchGenerator] = EngineBatchGenerator,
                      shared: Callable[[Any], set[int]] | None = None, **kw: Any) -> EngineBatchGenerator:
    """An ``EngineBatchGenerator`` (or ``generator_class``, a subclass) whose
    batches sample on the leader and share the tokens over ``group``; ``kw``
    are ``generator_class``'s.  ``shared``, if given, makes the generator's
    ``shared`` set (called with the generator)."""
    batch_class: type[ShardedGenerationBatch] = type(
        "ShardedGenerationBatch", (ShardedGenerationBatch,),
        {"group": group, "leader": leader, "shared_logprob_uids": logprob_uids})
    prompt_class = type("ShardedPromptBatch", (ShardedPromptBatch,), {"batch_class": batch_class})

    class _Sharded(generator_class):  # type: ignore[valid-type,misc]  # a class given at run time
        def _new_prompt_batch(self, uids: list[int], caches: list[list[Any]], **more: Any) -> EnginePromptBatch:
            return prompt_class(self.model, uids, caches, prefill_step_size=self.prefill_step_size,
                                fallback_sampler=self.sampler, scores=self.prompt_scores, **more)

    _Sharded.__name__ = _Sharded.__qualname__ = f"Sharded{generator_class.__name__}"
    gen = _Sharded(model, logprob_uids=logprob_uids, **kw)
    # the decode batch install() put in, swapped for the sharded one while empty
    batch = batch_class.empty(gen.model, gen.sampler)
    gen._generation_batch = batch
    if shared is not None:
        gen.shared = shared(gen)
        gen._prompt_batch = gen._new_prompt_batch([], [])  # empty still: the one holding the new set
    return gen
