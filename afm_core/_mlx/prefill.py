"""Prompt prefill without padding: each prompt runs at its own length.

mlx-lm's ``PromptProcessingBatch`` prefills a group of prompts as one
right-padded batch: every row is computed to the length of the longest, and
the padding is thrown away afterwards.  With prompts of mixed lengths that is
a lot of work for nothing (on the benchmark workload, 16-64 words per prompt
in groups of up to 8, mlx-lm computes 47% more rows than the prompts hold),
and on the CPU backend prefill costs in proportion to the rows computed.

:class:`EnginePromptBatch` keeps each prompt's own cache (mlx-lm's
single-sequence caches from ``make_prompt_cache`` or the prefix cache) and
runs each prompt's chunk through the model on it, exactly as long as it is;
all the rows of one chunk are evaluated together.  The rows are merged into
one batch cache (``_merge_caches``, which right-aligns them: the layout
mlx-lm's padded prefill ends with) only when they move on to decoding.  The
attention of every row sees exactly its own tokens, so the result is the one
mlx-lm's padded prefill computes.

:class:`EngineBatchGenerator` is mlx-lm's ``BatchGenerator`` with this prompt
batch and the engine's decode batch (``afm_core._mlx.batch``).  Its scheduling
(which prompts start when, chunking by ``prefill_step_size``) is mlx-lm's
own but for one change: a prompt whose prefill ends moves to the decode batch
in the same step, not at the start of the next (see
``EngineBatchGenerator._start_decoding``).
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch, _merge_caches

from .batch import Occupancy, install, occupancy

__all__ = ["EngineBatchGenerator", "EnginePromptBatch"]


class EnginePromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch with one cache per row (``rows``); see the
    module docstring.  mlx-lm's merged ``prompt_cache`` stays empty."""

    def __init__(self, model: Any, uids: list[int], caches: list[list[Any]], **kw: Any) -> None:
        super().__init__(model, uids, [], **kw)
        self.rows: list[list[Any]] = list(caches)

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
        todo = [(cache, ids) for cache, ids in zip(self.rows, tokens, strict=True) if ids]
        for seen, ids in zip(self.tokens, tokens, strict=True):
            seen += ids  # the tokens each cache holds, as mlx-lm keeps them
        start = 0
        while todo:
            states: list[Any] = []
            for cache, ids in todo:
                self.model(mx.array(ids[start : start + step])[None], cache=cache)
                states.extend(c.state for c in cache)
            mx.eval(states)
            mx.clear_cache()
            start += step
            todo = [(cache, ids) for cache, ids in todo if len(ids) > start]

    def generate(self, tokens: list[list[int]]) -> GenerationBatch:
        """Merge the rows into one batch cache and start decoding from each
        row's last token."""
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
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
        self.uids, self.rows, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens, self.stop_sequences = [], [], [], []
        return batch


class EngineBatchGenerator(BatchGenerator):
    """mlx-lm's ``BatchGenerator`` prefilling with :class:`EnginePromptBatch`
    and decoding with the engine's batch reading ``logprob_uids`` (see
    :func:`afm_core._mlx.batch.install`)."""

    def __init__(self, model: Any, *, logprob_uids: set[int], **kw: Any) -> None:
        super().__init__(model, **kw)
        install(self, logprob_uids)
        self._prompt_batch = self._new_prompt_batch([], [])

    def _new_prompt_batch(self, uids: list[int], caches: list[list[Any]], **kw: Any) -> EnginePromptBatch:
        return EnginePromptBatch(self.model, uids, caches, prefill_step_size=self.prefill_step_size,
                                 fallback_sampler=self.sampler, **kw)

    def occupancy(self) -> Occupancy:
        """How many sequences wait, prefill and decode (see :func:`.batch.occupancy`)."""
        return occupancy(self)

    @property
    def prompt_cache_nbytes(self) -> int:
        rows = self._prompt_batch.rows
        return int(super().prompt_cache_nbytes) + sum(c.nbytes for row in rows for c in row)

    def _next(self) -> tuple[list[Any], list[Any]]:
        prompt_responses, generation_responses = super()._next()
        self._start_decoding(prompt_responses)
        return prompt_responses, generation_responses

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
