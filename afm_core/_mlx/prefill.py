"""Prompt prefill at each prompt's own length (short chunks padded together).

mlx-lm's ``PromptProcessingBatch`` prefills a group of prompts as one
right-padded batch: every row is computed to the length of the longest, and
the padding is thrown away afterwards.  With prompts of mixed lengths that is
a lot of work for nothing (on the benchmark workload, 16-64 words per prompt
in groups of up to 8, mlx-lm computes 47% more rows than the prompts hold),
and on the CPU backend prefill costs in proportion to the rows computed.

:class:`EnginePromptBatch` keeps each prompt's own cache (mlx-lm's
single-sequence caches from ``make_prompt_cache`` or the prefix cache) and
runs each prompt's chunk through the model on it, exactly as long as it is;
all the rows of one chunk are evaluated together.  Short chunks are the
exception (:meth:`EnginePromptBatch._prefill_padded`): each small product
reads, or dequantizes, a whole weight, so eight 60-token prompts one by one
took about twice as long as one prompt of all their tokens; chunks of at
most :data:`PAD_MAX_TOKENS` tokens on caches of equal length run as one
batch padded on the right, in groups of at most :data:`PAD_WASTE` times
their tokens (:func:`padded_groups`).  The rows are merged into
one batch cache (``_merge_caches``, which right-aligns them: the layout
mlx-lm's padded prefill ends with) only when they move on to decoding.  The
attention of every row sees exactly its own tokens, so the result is the one
mlx-lm's padded prefill computes.

:class:`EngineBatchGenerator` is mlx-lm's ``BatchGenerator`` with this prompt
batch and the engine's decode batch (``afm_core._mlx.batch``).  Its scheduling
(which prompts start when, chunking by ``prefill_step_size``) is mlx-lm's
own but for two changes: a prompt whose prefill ends moves to the decode batch
in the same step, not at the start of the next (see
``EngineBatchGenerator._start_decoding``), and the step after that only
decodes, so its first token goes out without waiting for the next chunk of
the prompts still prefilling (mlx-lm's step returns its tokens only after
that chunk).

**Prompt scoring.**  A row registered in the generator's ``prompt_scores``
(:class:`PromptScores`, for a completion asking for its prompt's logprobs)
keeps the logits mlx-lm's prefill throws away: each chunk of its prompt runs
through the model in spans of at most ``SCORE_SPAN`` positions, and each
position's log-softmax gives the log-probability of the prompt's next token
and the most likely alternatives.  Only those rows compute the vocabulary
projection of every position (lazy evaluation skips it for the others, whose
prefill is unchanged); they must be prefilled from their first token (no
prefix cache), and the row's prefill waits for its own evaluations.

**Shared prefill.**  A row whose uid is in the generator's ``shared`` set
(other requests wait for the same prompt) has its cache deep-copied into
``prefilled[uid]`` when its prefill ends, in :meth:`EnginePromptBatch.generate`
(reached from mlx-lm's step and from ``_start_decoding`` alike), just before
the rows are merged into the decode batch.  The copy holds every prompt token
but the last, as the row does then; the caller takes it out of ``prefilled``
after the step and inserts the waiting requests with it.

**Prefill interleaved with decoding.**  mlx-lm's step decodes one token of
every running stream, then prefills one chunk of ``prefill_step_size``
tokens of each waiting prompt: the running streams wait for that chunk
between two of their tokens.  With ``prefill_step_decoding`` (a number of
tokens) the chunks are smaller while any stream decodes: they cost about
as much as that many tokens at the start of a prompt, counted with
:class:`PrefillCost` (a token's matrix products, plus its attention over the
keys before it: a chunk deep into a long prompt gets fewer tokens, so it
takes about as long), shared among the prompts prefilled in the step.  When
the step prefills more prompts than there are streams decoding, the budget
is that many tokens times their ratio: each prompt of a burst arriving behind
one stream gets the chunk a lone prompt would (a burst of eight short
prompts starts in one step, not three), and the decoding streams' pause
grows only while they are outnumbered by the requests waiting for a first
token.  With no stream decoding, a prompt is prefilled ``prefill_step_size``
tokens at a time, the fastest way to its first token.

**LoRA adapters.**  With ``adapters`` (:class:`~afm_core._mlx.lora.AdapterRows`),
each row's prompt chunks run with that row's adapter selected, and so does
the first decode step mlx-lm's ``GenerationBatch`` runs as it is made.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import (
    BatchGenerator,
    GenerationBatch,
    PromptProcessingBatch,
    StopSequences,
    _merge_caches,
)
from mlx_lm.models import cache as _cache
from mlx_lm.models.cache import make_prompt_cache

from . import half_cache
from .batch import Occupancy, install, occupancy
from .half_cache import DECODE_ROOM, reserve, to_half
from .lora import AdapterRows
from .quantized_cache import check_quantizable, make_quantized_cache
from .speculative import Speculation

__all__ = ["MIN_CHUNK", "PAD_MAX_OFFSET", "PAD_MAX_TOKENS", "PAD_WASTE", "SCORE_SPAN", "EngineBatchGenerator",
           "EnginePromptBatch", "PrefillCost", "PromptScores", "padded_groups"]

MIN_CHUNK = 16
"""The fewest tokens a prompt's chunk holds while streams decode, however far
into a long prompt it is (each step's fixed cost, a pass over every layer's
weights, must buy some progress)."""

PAD_MAX_TOKENS = 256
"""Prompt chunks of at most this many tokens, on caches of at most
:data:`PAD_MAX_OFFSET` tokens, run as padded batches (:func:`padded_groups`)
instead of one by one."""

PAD_MAX_OFFSET = 1024
"""The most tokens a row's cache may hold for its chunk to join a padded
batch (the batch copies the rows' caches in, and each row's back out)."""

PAD_WASTE = 1.5
"""A padded group's rows x longest prompt is at most this times its tokens."""

SCORE_SPAN = 256
"""Prompt positions a scored row runs through the model at once: its
log-softmax over the vocabulary is ``SCORE_SPAN x vocabulary`` floats."""

NO_STOP_TOKENS = StopSequences()
"""A row that stops at no token (``ignore_eos``): only ``max_tokens`` ends it."""


@dataclass(eq=False, slots=True)
class PromptScores:
    """One row's prompt, scored during its prefill (see the module docstring).

    After prefill ``logprobs[i]`` is log P(``tokens[i + 1]`` | ``tokens[: i + 1]``)
    and ``top_ids[i]`` / ``top_logprobs[i]`` the ``top_k`` most likely ids at
    that position with theirs, best first; ``error`` says why not, when the
    model does not return the logits of every position.
    """

    tokens: Sequence[int]
    top_k: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    error: str | None = None

    def score(self, model: Any, ids: list[int], cache: list[Any], at: int) -> None:
        """Run ``ids`` (the prompt from position ``at``) through ``model`` on
        ``cache``, recording every position that has a next prompt token."""
        for s in range(0, len(ids), SCORE_SPAN):
            piece = ids[s : s + SCORE_SPAN]
            logits = model(mx.array(piece)[None], cache=cache)
            states = [c.state for c in cache]
            wanted = min(len(piece), len(self.tokens) - 1 - (at + s))
            if self.error is not None or wanted <= 0:
                mx.eval(states)
                continue
            if logits.ndim != 3 or logits.shape[1] != len(piece):
                self.error = "this model does not return the logits of every prompt position"
                mx.eval(states)
                continue
            rows = logits[0, :wanted].astype(mx.float32)
            rows = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
            start = at + s + 1
            targets = mx.array(list(self.tokens[start : start + wanted]))
            chosen = mx.take_along_axis(rows, targets[:, None], axis=-1)[:, 0]
            outs = [chosen]
            k = min(self.top_k, rows.shape[-1])
            if k > 0:
                top = mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]
                outs += [top, mx.take_along_axis(rows, top, axis=-1)]
            mx.eval(outs, states)
            self.logprobs.extend(chosen.tolist())  # type: ignore[arg-type]  # 1-D: a list of floats
            if k > 0:
                ids_rows: list[list[int]] = outs[1].tolist()  # type: ignore[assignment]
                val_rows: list[list[float]] = outs[2].tolist()  # type: ignore[assignment]
                for tid, val in zip(ids_rows, val_rows, strict=True):
                    order = sorted(range(k), key=val.__getitem__, reverse=True)
                    self.top_ids.append([tid[j] for j in order])
                    self.top_logprobs.append([val[j] for j in order])


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """What prefilling costs, in multiply-adds: ``per_token`` for a token's
    matrix products, plus ``per_key`` for each key its attention reads (every
    earlier token of its prompt, and itself)."""

    per_token: float
    per_key: float

    @classmethod
    def of(cls, model: Any) -> PrefillCost:
        """The costs of ``model``: its layers' linear weights (quantized ones
        counted unpacked), and from its config, every layer's query heads
        times their size, twice (the scores, then the weighted values)."""
        import mlx.nn as nn

        from .qmatmul import input_dims

        per_token = 0.0
        layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None), "layers", [])
        for layer in layers:
            for _, m in layer.named_modules():
                if isinstance(m, nn.QuantizedLinear):
                    per_token += m.weight.shape[0] * input_dims(m)
                elif isinstance(m, nn.Linear):
                    per_token += m.weight.size
        args = getattr(model, "args", None)
        heads = getattr(args, "num_attention_heads", 0) or 0
        hidden = getattr(args, "hidden_size", 0) or 0
        head_dim = getattr(args, "head_dim", None) or (hidden // heads if heads else 0)
        return cls(per_token=per_token, per_key=2.0 * len(layers) * heads * head_dim)

    def chunk(self, budget_tokens: int, offsets: Sequence[int]) -> int:
        """The most tokens ``n`` each of the prompts at ``offsets`` (tokens
        already in their caches) may prefill in one step for all of them to
        cost what ``budget_tokens`` tokens cost at the start of one prompt:
        the largest n with sum over rows of n (per_token + per_key (o + n / 2))
        <= budget_tokens per_token (at least ``MIN_CHUNK``)."""
        rows = len(offsets)
        if rows == 0 or self.per_token <= 0:
            return max(MIN_CHUNK, budget_tokens // max(rows, 1))
        budget = budget_tokens * self.per_token
        a = rows * self.per_key / 2.0
        b = rows * self.per_token + self.per_key * sum(offsets)
        n = budget / b if a == 0 else (-b + math.sqrt(b * b + 4.0 * a * budget)) / (2.0 * a)
        return max(MIN_CHUNK, int(n))


def padded_groups(lengths: Sequence[int]) -> list[list[int]]:
    """Indices of ``lengths`` (short prompts) in groups of two or more whose
    padded batch (rows x the longest) is at most :data:`PAD_WASTE` times their
    tokens, longest prompts first; a prompt in no group runs on its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    while order:
        group = [order.pop(0)]
        width, tokens = lengths[group[0]], lengths[group[0]]
        while order and (len(group) + 1) * width <= PAD_WASTE * (tokens + lengths[order[0]]):
            tokens += lengths[order[0]]
            group.append(order.pop(0))
        if len(group) > 1:
            groups.append(group)
    return groups


def _kv_kind(cache: list[Any]) -> tuple[type, int] | None:
    """The KV class and length of ``cache`` (one row's) when every layer is a
    plain or float16 ``KVCache`` of one class holding at most
    :data:`PAD_MAX_OFFSET` tokens; None otherwise."""
    kinds = {type(c) for c in cache}
    offsets = {c.offset for c in cache}
    if len(kinds) != 1 or len(offsets) != 1:
        return None
    kind, offset = kinds.pop(), offsets.pop()
    if kind not in (_cache.KVCache, half_cache.KVCache) or offset > PAD_MAX_OFFSET:
        return None
    return kind, offset


class EnginePromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch with one cache per row (``rows``); see the
    module docstring.  mlx-lm's merged ``prompt_cache`` stays empty."""

    def __init__(self, model: Any, uids: list[int], caches: list[list[Any]], *,
                 scores: dict[int, PromptScores] | None = None, shared: set[int] | None = None,
                 prefilled: dict[int, list[Any]] | None = None, adapters: AdapterRows | None = None,
                 **kw: Any) -> None:
        super().__init__(model, uids, [], **kw)
        self.adapters = adapters
        self.rows: list[list[Any]] = list(caches)
        self.scores: dict[int, PromptScores] = {} if scores is None else scores
        self.shared: set[int] = set() if shared is None else shared
        self.prefilled: dict[int, list[Any]] = {} if prefilled is None else prefilled

    def extract_cache(self, idx: int) -> list[Any]:
        return self.rows[idx]

    def extend(self, batch: Any) -> None:
        self.rows.extend(batch.rows)
        super().extend(batch)

    def _copy(self) -> EnginePromptBatch:
        """A copy sharing the rows' caches: mlx-lm's ``split`` copies, then
        filters each side to its own rows, so no cache is in both (mlx-lm
        deep-copies its merged cache here)."""
        return copy.copy(self)

    def filter(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        super().filter(keep)

    def prompt(self, tokens: list[list[int]]) -> None:
        """Run each row's ``tokens`` through the model on the row's own cache."""
        if len(self.uids) != len(tokens):
            raise ValueError("The batch length doesn't match the number of inputs")
        step = self.prefill_step_size
        scores = self.scores
        todo = []
        for uid, cache, seen, ids in zip(self.uids, self.rows, self.tokens, tokens, strict=True):
            if ids:
                # a scored row's cache starts empty: len(seen) is its position in the prompt
                todo.append((uid, cache, ids, scores.get(uid), len(seen)))
            seen += ids  # the tokens each cache holds, as mlx-lm keeps them
        start = 0
        adapters = self.adapters
        while todo:
            states: list[Any] = []
            if start == 0 and adapters is None:  # (later passes hold only prompts longer than a step)
                todo, states = self._prefill_padded(todo, step)
            for uid, cache, ids, scored, at in todo:
                chunk = ids[start : start + step]
                if adapters is not None:
                    adapters.select_rows((uid,))
                try:
                    if scored is not None:
                        scored.score(self.model, chunk, cache, at + start)
                        continue
                    self.model(mx.array(chunk)[None], cache=cache)
                finally:
                    if adapters is not None:
                        adapters.clear()
                states.extend(c.state for c in cache)
            mx.eval(states)
            mx.clear_cache()
            start += step
            todo = [row for row in todo if len(row[2]) > start]

    def _prefill_padded(self, todo: list[Any], step: int) -> tuple[list[Any], list[Any]]:
        """Prefill the short chunks of ``todo`` as padded batches (rows whose
        caches hold the same number of tokens, :func:`padded_groups`); returns
        the rows left to prefill one by one and the arrays to evaluate.

        Several short chunks computed one by one cost about twice what one
        prompt of all their tokens does (each small product reads, or
        dequantizes, the whole weight: ``benchmarks/prefill_rows.py``); as one
        batch they cost what its padded rows do.  The rows' caches (of equal
        lengths) are merged into one mlx-lm ``BatchKVCache`` and each chunk is
        padded on the right: causal attention keeps every real token from
        the padding after it, and each row's cache is then its row of the
        batch with the padding trimmed off."""
        kinds: dict[int, tuple[type, int]] = {}
        for i, (_, cache, ids, scored, _) in enumerate(todo):
            found = _kv_kind(cache) if scored is None and len(ids) <= min(step, PAD_MAX_TOKENS) else None
            if found is not None:
                kinds[i] = found
        groups = []
        for found in set(kinds.values()):
            same = [i for i in kinds if kinds[i] == found]
            groups += [[same[j] for j in g] for g in padded_groups([len(todo[i][2]) for i in same])]
        if not groups:
            return todo, []
        states: list[Any] = []
        for group in groups:
            rows = [todo[i] for i in group]
            kind, offset = kinds[group[0]]
            width = max(len(ids) for _, _, ids, _, _ in rows)
            pads = [width - len(ids) for _, _, ids, _, _ in rows]
            batch_kind = half_cache.BatchKVCache if kind is half_cache.KVCache else _cache.BatchKVCache
            layers = len(rows[0][1])
            batch = ([batch_kind([0] * len(rows)) for _ in range(layers)] if offset == 0 else
                     [batch_kind.merge([cache[layer] for _, cache, _, _, _ in rows]) for layer in range(layers)])
            self.model(mx.array([list(ids) + [0] * pad for pad, (_, _, ids, _, _) in zip(pads, rows, strict=True)]),
                       cache=batch)
            for i, ((_, cache, _, _, _), pad) in enumerate(zip(rows, pads, strict=True)):
                cache[:] = [layer.extract(i) for layer in batch]
                for layer in cache:
                    layer.trim(pad)
                states.extend(c.state for c in cache)
        done = {i for g in groups for i in g}
        return [row for i, row in enumerate(todo) if i not in done], states

    def generate(self, tokens: list[list[int]]) -> GenerationBatch:
        """Merge the rows into one batch cache and start decoding from each
        row's last token."""
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        if self.shared:
            for uid, row in zip(self.uids, self.rows, strict=True):
                if uid in self.shared:
                    # before merging: the copy must not share arrays the decode batch writes
                    self.shared.discard(uid)
                    self.prefilled[uid] = copy.deepcopy(row)
        adapters = self.adapters
        if adapters is not None:  # mlx-lm's batch runs its first step as it is made
            adapters.select_rows(self.uids)
        try:
            batch = GenerationBatch(
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
        finally:
            if adapters is not None:
                adapters.clear()
        self.uids, self.rows, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens, self.stop_sequences = [], [], [], []
        return batch


class EngineBatchGenerator(BatchGenerator):
    """mlx-lm's ``BatchGenerator`` prefilling with :class:`EnginePromptBatch`
    and decoding with the engine's batch reading ``logprob_uids`` and
    speculating with ``speculation`` if given (see
    :func:`afm_core._mlx.batch.install`, :mod:`afm_core._mlx.speculative`).  ``prompt_scores`` holds the rows
    whose prompts are scored, by uid (see :meth:`insert_one`).

    With ``kv_bits`` (4 or 8) every row's cache is quantized from its first
    token (:mod:`.quantized_cache`, ``kv_group_size`` elements per scale);
    a model whose cache cannot be is refused here (ValueError).  Otherwise,
    with ``kv_half``, the plain KV layers store float16 (:mod:`.half_cache`).

    With ``prefill_step_decoding`` > 0 a step prefills smaller chunks while
    streams decode (see the module docstring; ``full_step`` is the
    ``prefill_step_size`` given).

    ``shared`` holds the uids of rows whose prefilled cache other requests
    wait for: when such a row's prefill ends, a deep copy of its cache
    (every prompt token but the last) lands in ``prefilled[uid]`` and the uid
    leaves ``shared``.  The caller adds the uids, and empties ``prefilled``
    after each :meth:`next`."""

    def __init__(self, model: Any, *, logprob_uids: set[int], adapters: AdapterRows | None = None,
                 kv_bits: int | None = None, kv_group_size: int = 64, kv_half: bool = False,
                 speculation: Speculation | None = None, prefill_step_decoding: int = 0,
                 **kw: Any) -> None:
        super().__init__(model, **kw)
        self.full_step = self.prefill_step_size
        self.prefill_step_decoding = prefill_step_decoding
        self.cost = PrefillCost.of(model) if prefill_step_decoding > 0 else None
        self.adapters = adapters
        install(self, logprob_uids, adapters, speculation)
        self.speculation = speculation
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.kv_half = kv_half and kv_bits is None
        if kv_bits is not None:
            check_quantizable(model, kv_group_size)
        self.prompt_scores: dict[int, PromptScores] = {}
        self.shared: set[int] = set()
        self.prefilled: dict[int, list[Any]] = {}
        self._prompt_batch = self._new_prompt_batch([], [])
        self._first_tokens_due = False  # rows began decoding in the last step

    def _new_prompt_batch(self, uids: list[int], caches: list[list[Any]], **kw: Any) -> EnginePromptBatch:
        return EnginePromptBatch(self.model, uids, caches, prefill_step_size=self.prefill_step_size,
                                 fallback_sampler=self.sampler, scores=self.prompt_scores,
                                 shared=self.shared, prefilled=self.prefilled, adapters=self.adapters, **kw)

    def insert_one(self, prompt: list[int], *, max_tokens: int, cache: list[Any] | None,
                   all_tokens: list[int], sampler: Any, logits_processors: list[Any],
                   stop_at_eos: bool = True, scores: PromptScores | None = None, adapter: int = 0) -> int:
        """Insert one sequence (mlx-lm's ``insert``) and return its uid.

        ``prompt`` is what is left to prefill after ``cache`` (holding
        ``all_tokens``); ``stop_at_eos`` False ends the row at ``max_tokens``
        only; ``scores`` (whose ``tokens`` are the whole prompt, ``cache``
        then None) scores the prompt during prefill.  Its entry leaves
        ``prompt_scores`` with :meth:`remove` or :meth:`forget_scores`.
        ``adapter`` (an index of ``adapters``, 0: none) is the LoRA adapter
        the row runs with (see :mod:`afm_core._mlx.lora`), until :meth:`remove`
        or :meth:`forget_scores`.
        Without ``cache`` the row starts on :meth:`new_cache`.
        """
        if cache is None and (self.kv_bits is not None or self.kv_half):
            cache = self.new_cache()
        elif cache is not None and self.kv_half:
            to_half(cache)  # (a prefix cache entry read back from disk is mlx-lm's class)
        if cache is not None and self.kv_half:  # the prompt's whole length at once, not chunk by chunk
            reserve(cache, len(all_tokens) + len(prompt) + min(max_tokens, DECODE_ROOM))
        (uid,) = self.insert(
            [prompt], max_tokens=[max_tokens], caches=[cache] if cache is not None else None,
            all_tokens=[all_tokens], samplers=[sampler], logits_processors=[logits_processors],
            stop_sequences=None if stop_at_eos else [NO_STOP_TOKENS],
        )
        if scores is not None:
            self.prompt_scores[uid] = scores
        if adapter:
            if self.adapters is None or not 0 < adapter <= len(self.adapters.names):
                super().remove([uid])
                raise ValueError(f"no adapter {adapter} in this generator")
            self.adapters.of[uid] = adapter
        return int(uid)

    def new_cache(self) -> list[Any]:
        """An empty single-sequence cache for a row: mlx-lm's, with ``kv_half``
        its float16 twin (:mod:`.half_cache`), or with ``kv_bits`` a
        quantized one (:mod:`.quantized_cache`)."""
        if self.kv_bits is None:
            cache = list(make_prompt_cache(self.model))
            return to_half(cache) if self.kv_half else cache
        return make_quantized_cache(self.model, bits=self.kv_bits, group_size=self.kv_group_size)

    def forget_scores(self, uid: int) -> None:
        """Drop what the generator keeps of a finished row (its scores, its adapter)."""
        self.prompt_scores.pop(uid, None)
        if self.adapters is not None:
            self.adapters.of.pop(uid, None)

    def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
        for uid in uids:
            self.prompt_scores.pop(uid, None)
            if self.adapters is not None:
                self.adapters.of.pop(uid, None)
            self.shared.discard(uid)
            self.prefilled.pop(uid, None)
        return super().remove(uids, return_prompt_caches)

    def occupancy(self) -> Occupancy:
        """How many sequences wait, prefill and decode (see :func:`.batch.occupancy`)."""
        return occupancy(self)

    @property
    def prompt_cache_nbytes(self) -> int:
        rows = self._prompt_batch.rows
        return int(super().prompt_cache_nbytes) + sum(c.nbytes for row in rows for c in row)

    def _next(self) -> tuple[list[Any], list[Any]]:
        step = self._chunk_size()
        self.prefill_step_size = self._prompt_batch.prefill_step_size = step
        if self._first_tokens_due and len(self._generation_batch) > 0:
            # decode only: mlx-lm's step returns early when the decode batch is full
            full, self.completion_batch_size = self.completion_batch_size, 0
            try:
                prompt_responses, generation_responses = super()._next()
            finally:
                self.completion_batch_size = full
        else:
            prompt_responses, generation_responses = super()._next()
            self._start_decoding(prompt_responses)
        self._first_tokens_due = any(r.end_of_prompt for r in prompt_responses)
        return prompt_responses, generation_responses

    def _chunk_size(self) -> int:
        """This step's prefill chunk per prompt (see the module docstring):
        ``full_step`` unless streams decode and ``prefill_step_decoding`` is
        set, then that budget (times prompts per decoding stream, if above 1)."""
        if self.cost is None or len(self._generation_batch) == 0:
            return self.full_step
        # the prompts this step prefills: those under way, then those mlx-lm starts now
        offsets = [len(t) for t in self._prompt_batch.tokens]
        room = min(self.prefill_batch_size - len(self._prompt_batch),
                   self.completion_batch_size - len(self._generation_batch))
        offsets += [len(seq[4]) for _, seq in zip(range(max(room, 0)), self._unprocessed_sequences,
                                                  strict=False)]
        budget = self.prefill_step_decoding * max(1.0, len(offsets) / len(self._generation_batch))
        return min(self.full_step, self.cost.chunk(int(budget), offsets))

    def _start_decoding(self, prompt_responses: list[Any]) -> None:
        """Move the prompts whose prefill just ended (only their last token is
        left) into the decode batch now.  mlx-lm's step does it at the start of
        the next step, so their places in the prefill group stay taken for a
        step and it starts at most ``prefill_batch_size`` prompts every other
        step.  This is the same move as mlx-lm's, one step earlier."""
        if len(self._generation_batch) >= self.completion_batch_size:
            return  # mlx-lm's step moves nothing then either
        waiting = self._currently_processing
        done = [i for i, (segments, *_) in enumerate(waiting) if len(segments) == 1 and len(segments[0]) == 1]
        if not done:
            return
        last = [waiting[i][0][0] for i in done]
        progress = [waiting[i][2] for i in done]
        moving = set(done)
        self._currently_processing = [w for i, w in enumerate(waiting) if i not in moving]
        batch = self._prompt_batch.split(done).generate(last)
        for uid, total in zip(batch.uids, progress, strict=True):
            prompt_responses.append(PromptProcessingBatch.Response(uid, (total, total), True, True))
        self._generation_batch.extend(batch)

    def _make_batch(self, n: int) -> EnginePromptBatch:
        """mlx-lm's ``_make_batch``: the next ``n`` waiting prompts, as an
        :class:`EnginePromptBatch`."""
        taken = [self._unprocessed_sequences.popleft() for _ in range(n)]
        for seq in taken:
            self._currently_processing.append([seq[1], 0, sum(len(s) for s in seq[1])])
        # a waiting sequence is (uid, segments, max_tokens, cache, all_tokens,
        # sampler, logits_processors, stop_sequences); see BatchGenerator.insert_segments
        return self._new_prompt_batch(
            [s[0] for s in taken], [s[3] for s in taken],
            tokens=[s[4] for s in taken], samplers=[s[5] for s in taken],
            logits_processors=[s[6] for s in taken], max_tokens=[s[2] for s in taken],
            stop_sequences=[s[7] for s in taken],
        )
