"""The engine's decode batch: mlx-lm's ``GenerationBatch`` with three per-step costs removed.

mlx-lm's batch (``mlx_lm.generate.GenerationBatch``) is what every step of
``BatchGenerator`` runs.  Three of its habits cost time on every step for
nothing the engine uses:

* it splits the step's log-probabilities into one array per row
  (``list(logprobs)``: a slice op per stream, evaluated every step) although
  only requests asking for ``logprobs`` read them.  Here only those rows are
  split; the others carry ``None``.
* when the rows do not all share one sampler object it samples every row in
  its own call.  Here rows sharing a sampler (the engine shares one per set of
  sampling parameters, see :class:`afm_core._engine.sampling.SamplerCache`) are
  sampled together, one call per distinct sampler.
* every layer of its cache advances its own copy of the rows' offsets, the
  same numbers in every layer.  Here the plain KV layers share one
  (:func:`share_offsets`).

Everything else (the forward pass, logits processors, the pipelined
``async_eval`` of the next step, token bookkeeping) is the same sequence of
operations as mlx-lm's, so outputs are identical.  Every ``SETTLE_EVERY``
steps the cache state is evaluated too (see there).  :func:`install` swaps the
batch into a ``BatchGenerator`` (it keeps one decode batch for its whole life
and extends it with each prefilled group).  :func:`occupancy` counts where a
generator's sequences are, so no caller reads its private fields.
Before each forward the rows' LoRA adapters are selected by their uids
(``afm_core._mlx.lora.AdapterRows``), so they follow mlx-lm's inserts and filters.

With a :class:`~afm_core._mlx.speculative.Speculation` (``speculation``,
seen here through its :class:`Verifier` face) a step may be a verify step instead (see :mod:`.speculative`): its rows may
each answer several tokens, as several responses of the same uid
(:meth:`EngineGenerationBatch.respond`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models import cache as _cache
from mlx_lm.sample_utils import Sampler

from . import half_cache
from .lora import AdapterRows

__all__ = ["EngineGenerationBatch", "Occupancy", "Verifier", "install", "occupancy", "process_rows", "share_offsets",
           "shares_offset"]

SETTLE_EVERY = 64
"""Steps between evaluations of the whole cache state.  A model that never
reads part of its cache (a layer without RoPE never reads the offset) would
otherwise grow a lazy graph, holding memory, for as long as the batch runs."""


class Verifier(Protocol):
    """What the batch asks of its speculation (``afm_core._mlx.speculative.Speculation``,
    which builds on this module, so the batch names only this face of it)."""

    def step(self, batch: EngineGenerationBatch) -> list[Any] | None:
        """One verify step of ``batch`` (its responses), or None: a plain step is due."""
        ...

    def retain(self, uids: list[int]) -> None:
        """Only ``uids`` are still in the batch."""
        ...


class EngineGenerationBatch(GenerationBatch):
    """See the module docstring.  ``logprob_uids`` are the rows whose
    log-probabilities the engine reads."""

    logprob_uids: set[int]
    adapters: AdapterRows | None = None
    """The rows' LoRA adapters (``afm_core._mlx.lora``), selected for each step."""
    speculation: Verifier | None = None
    _steps = 0  # decode steps run; instances count from the class default

    def next(self) -> list[GenerationBatch.Response]:
        spec = self.speculation
        if spec is not None and self.uids:
            verified = spec.step(self)
            if verified is not None:
                return verified
        responses: list[GenerationBatch.Response] = super().next()
        return responses

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        if self.speculation is not None:
            self.speculation.retain(self.uids)

    def respond(self, emitted: list[list[int]], logprobs: list[Any],
                later: list[list[Any]] | None = None) -> list[GenerationBatch.Response]:
        """mlx-lm's ``next`` bookkeeping for a step whose row ``i`` emitted the
        tokens ``emitted[i]`` (all in its cache and ``tokens``): one response
        per token, until the row's ``max_tokens`` or stop sequence ends it (the
        cache and tokens it leaves with then end at that token).  The first
        token's log-probabilities are ``logprobs[i]``, the others' ``later[i]``
        (None where not given)."""
        keep: list[int] = []
        responses: list[GenerationBatch.Response] = []
        for i, toks in enumerate(emitted):
            uid = self.uids[i]
            finish = None
            for j, t in enumerate(toks):
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                if self._matchers[i].advance(t):
                    finish = "stop"
                # mlx-lm types it an array; the engine reads it only for the rows asking
                lp: Any = logprobs[i] if j == 0 else later[i][j - 1] if later and later[i] else None
                if finish is None:
                    responses.append(self.Response(uid, t, lp, None, None, None))
                    continue
                extra = len(toks) - j - 1
                cache = self.extract_cache(i)
                tokens = self.tokens[i]
                if extra:
                    for c in cache:
                        c.trim(extra)
                    tokens = tokens[:-extra]
                responses.append(self.Response(uid, t, lp, finish, cache, tokens))
                break
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    def _step(self) -> tuple[list[int], list[Any]]:
        inputs: mx.array = self._next_tokens
        # mlx-lm's __init__ sets it to None, so its inferred type is None alone
        self._current_tokens = inputs  # type: ignore[assignment]
        self._current_logprobs = self._next_logprobs

        adapters = self.adapters
        if adapters is not None:
            adapters.select_rows(self.uids)
        try:
            logits = self.model(inputs[:, None], cache=self.prompt_cache)
        finally:
            if adapters is not None:
                adapters.clear()
        share_offsets(self.prompt_cache)
        logits = logits[:, -1, :]

        logits, token_context = process_rows(self, logits, inputs)

        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = self._sample(logprobs)

        wanted = self.logprob_uids
        self._next_tokens = sampled
        self._next_logprobs = [logprobs[i] if uid in wanted else None
                               for i, uid in enumerate(self.uids)] if wanted else [None] * len(self.uids)
        self._steps += 1
        settle = self._cache_state() if self._steps % SETTLE_EVERY == 0 else []
        mx.async_eval(self._next_tokens, self._next_logprobs, token_context, settle)

        mx.eval(inputs, self._current_logprobs)
        tokens: list[int] = inputs.tolist()  # type: ignore[assignment]  # mlx annotates any ndim; 1-D is a list
        for seq, t in zip(self.tokens, tokens, strict=True):
            seq.append(t)
        return tokens, self._current_logprobs

    def _cache_state(self) -> list[mx.array]:
        # a quantized cache's keys and values are (data, scales, biases) triples
        flat: list[tuple[str, Any]] = tree_flatten([c.state for c in self.prompt_cache])  # type: ignore[assignment]
        return [x for _, x in flat if isinstance(x, mx.array)]

    def _sample(self, logprobs: mx.array) -> mx.array:
        """One sampler call per distinct sampler object, results in row order."""
        return self.sample_rows(logprobs)

    def sample_rows(self, logprobs: mx.array, rows: Sequence[int] | None = None) -> mx.array:
        """:meth:`_sample` of the batch rows ``rows`` (whose ``logprobs`` these
        are; all rows if None): a verify step samples the rows that did not speculate."""
        row_samplers: Sequence[Sampler | None] = self.samplers or [None] * len(self.uids)
        if rows is not None:
            row_samplers = [row_samplers[r] for r in rows]
        samplers = [self.fallback_sampler if s is None else s for s in row_samplers]
        first = samplers[0] if samplers else self.fallback_sampler
        if all(s is first for s in samplers):
            return first(logprobs)
        groups: dict[int, tuple[Any, list[int]]] = {}
        for row, s in enumerate(samplers):
            groups.setdefault(id(s), (s, []))[1].append(row)
        order: list[int] = []
        parts = []
        for s, rows in groups.values():
            parts.append(s(logprobs[mx.array(rows)]) if len(rows) > 1 else s(logprobs[rows[0] : rows[0] + 1]))
            order.extend(rows)
        inverse = [0] * len(order)
        for pos, row in enumerate(order):
            inverse[row] = pos
        return mx.concatenate(parts, axis=0)[mx.array(inverse)]


def share_offsets(caches: Sequence[Any]) -> None:
    """Point the plain batch KV layers of one batch at one ``offset`` array.

    mlx-lm's ``BatchKVCache`` advances its per-row ``offset`` in every layer
    (``offset + n``: a broadcast and an addition per layer, read by the next
    step's rotary embeddings).  Every plain batch layer of a batch holds the
    same rows with the same tokens (mlx-lm filters, extends and trims all of
    them alike), so their offsets are equal: after a forward the first
    layer's serves them all, and the others' additions are dropped
    unevaluated (58 operations fewer per step on a 30-layer model).

    The sliding-window layers (``BatchRotatingKVCache``, Gemma 3's) in the
    same state as the first of them get its ``offset`` too; mlx-lm's update
    still ties each layer's own addition to its keys (``mx.depends``), but
    the decode layout's write of a layer that :func:`shares_offset` leaves
    it out (``decode_layout``: 42 operations fewer on Gemma-3-270M while
    its windows fill).  Their ``left_padding`` stays each layer's own
    (mlx-lm decrements it in place).  Layers of other kinds (quantized)
    keep their own."""
    first = lead = None
    for c in caches:
        if type(c) is _cache.BatchRotatingKVCache:
            if lead is None:
                lead = c
            elif _same_window(c, lead):
                c.offset = lead.offset
                _shared_offsets[c] = lead.offset
            continue
        if type(c) not in _PLAIN_BATCH_LAYERS:
            continue
        if first is None:
            first = c
        elif c._idx == first._idx and c.offset is not first.offset and c.offset.shape == first.offset.shape:
            c.offset = first.offset


def _same_window(c: Any, lead: Any) -> bool:
    """Whether two rotating batch layers hold the same positions of the same rows."""
    return (c.max_size == lead.max_size and c._offset == lead._offset and c._idx == lead._idx
            and c.rotated == lead.rotated and c._lengths is None and lead._lengths is None
            and c.keys is not None and lead.keys is not None and c.keys.shape[2] == lead.keys.shape[2]
            and c.offset is not lead.offset and c.offset.shape == lead.offset.shape)


_shared_offsets: weakref.WeakKeyDictionary[Any, mx.array] = weakref.WeakKeyDictionary()
"""The ``offset`` :func:`share_offsets` gave each rotating layer (not the first)."""


def shares_offset(cache: Any) -> bool:
    """Whether ``cache`` (a rotating batch layer) still holds the ``offset``
    :func:`share_offsets` gave it from its batch's first rotating layer:
    its own advance of the offset is then dropped at the next share."""
    held = _shared_offsets.get(cache)
    return held is not None and held is cache.offset


_PLAIN_BATCH_LAYERS = (_cache.BatchKVCache, half_cache.BatchKVCache)


@dataclass(frozen=True, slots=True)
class Occupancy:
    """Where a ``BatchGenerator``'s sequences are, counted at one moment."""

    decoding: int
    """Rows of the decode batch (``_generation_batch``)."""
    prefilling: int
    """Rows of the prompt batch, being prefilled (``_prompt_batch``)."""
    waiting: int
    """Inserted sequences whose prefill has not started (``_unprocessed_sequences``)."""

    @property
    def empty(self) -> bool:
        """No sequence anywhere: a step would do nothing."""
        return not (self.decoding or self.prefilling or self.waiting)


def occupancy(gen: BatchGenerator) -> Occupancy:
    """How many of ``gen``'s sequences wait, prefill and decode (mlx-lm keeps
    these counts in private fields only)."""
    return Occupancy(decoding=len(gen._generation_batch), prefilling=len(gen._prompt_batch),
                     waiting=len(gen._unprocessed_sequences))


def process_rows(batch: GenerationBatch, logits: mx.array,
                 inputs: mx.array) -> tuple[mx.array, list[Any]]:
    """Each row's ``logits`` (one row per batch row) through that row's logits
    processors, fed its token context with ``inputs`` (mlx-lm's ``_step``
    loop; the plain and the verify step share it); returns the logits and the
    contexts the processors read (to evaluate with the step)."""
    token_context: list[Any] = []
    all_processors = batch.logits_processors
    if not (all_processors and any(all_processors)):
        return logits, token_context
    rows = []
    for e in range(logits.shape[0]):
        row = logits[e : e + 1]
        processors = all_processors[e] or ()
        if processors:
            context = batch._token_context[e].update_and_fetch(inputs[e : e + 1])
            token_context.append(context)
            for processor in processors:
                row = processor(context, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0), token_context


def install(gen: BatchGenerator, logprob_uids: set[int], adapters: AdapterRows | None = None,
            speculation: Verifier | None = None) -> None:
    """Make ``gen`` decode with an :class:`EngineGenerationBatch` reading
    ``logprob_uids`` (a live set the caller keeps up to date), selecting
    each row's LoRA adapter from ``adapters`` and speculating with
    ``speculation`` if given."""
    if not occupancy(gen).empty:
        raise RuntimeError("install the engine batch before the first insert")
    batch = EngineGenerationBatch.empty(gen.model, gen.sampler)
    batch.logprob_uids = logprob_uids
    batch.adapters = adapters
    batch.speculation = speculation
    gen._generation_batch = batch
