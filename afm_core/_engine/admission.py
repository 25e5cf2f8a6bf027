"""Admission: how a job enters mlx-lm's batch on the generation thread.

A submitted job is inserted into the batch with what the prefix cache's tiers
hold of its prompt (:mod:`.prefix_tiers`), waits out of the batch for a disk
read, or parks on the job prefilling the same prompt (:mod:`.shared_prefill`)
and is inserted with a copy of its cache when that prefill ends.

**Prompt progress.**  A job with ``progress`` gets
:class:`~afm_core._stream.events.PromptProgress` events: when it is inserted
(``processed`` = its cached tokens), for each prefill chunk (mlx-lm's prompt
responses), and ``processed == total`` when its prefill ends, the step before
its first token; they go ahead of the job's other events of the same loop
iteration.

:class:`Admission` is a part of :class:`~.worker.Worker` (its base class): the
state it uses is the worker's, declared below.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._stream.events import Event, PromptProgress, StreamFailure
from .commands import Delivery, Job, JobKey, MlxUid, Outputs
from .kv_memory import vocab_size

if TYPE_CHECKING:
    import mlx.nn as nn

    from .._mlx.disk_cache import DiskMatch
    from .._mlx.prefill import EngineBatchGenerator, PromptScores
    from .prefix_tiers import PrefixTiers
    from .sampling import SamplerCache
    from .shared_prefill import SharedPrefill
    from .stats import WorkerStats

log = logging.getLogger("afm.engine")


class Admission:
    """Admitting jobs (see the module docstring); the worker's base class."""

    # the worker's state and steps this part uses (set and defined by Worker)
    model: nn.Module
    gen: EngineBatchGenerator
    samplers: SamplerCache
    stats: WorkerStats
    tiers: PrefixTiers
    prefill: SharedPrefill
    by_key: dict[JobKey, Job]
    by_uid: dict[MlxUid, Job]
    logprob_uids: set[int]
    early: dict[JobKey, list[Event]]
    _end: Callable[[Job, str], list[Event]]

    def _admit(self, job: Job, outputs: Outputs) -> None:
        """Insert ``job`` into mlx-lm's batch, or park it on the job prefilling
        its prompt (see :mod:`.shared_prefill`)."""
        if not job.t_admitted:  # (a parked job whose leader left comes back here)
            job.t_admitted = time.perf_counter()
            if job.profile is not None:
                job.profile.admitted(job.t_admitted)
        if job.max_tokens == 0 and job.prompt_top_logprobs is None:
            # a completion asking for nothing: no prefill, no token
            outputs[job.key] = Delivery(tuple(self._end(job, "length")), True)
            return
        if self.prefill.park(job):
            self.by_key[job.key] = job
            return
        try:
            prompt = job.prompt
            scores = None
            if job.prompt_top_logprobs is not None:
                from .._mlx.prefill import PromptScores

                # every position's logits are needed: no prefix cache, the whole prompt prefilled
                scores = PromptScores(prompt, job.prompt_top_logprobs)
            cache, rest = None, prompt
            if self.tiers.caching and scores is None:
                self.tiers.counts.lookups += 1
                if self.tiers.read_disk(job):
                    self.by_key[job.key] = job
                    return  # admitted when its entry has been read (_disk_done)
                cache, rest = self.tiers.fetch_memory(prompt, job.adapter)
            job.cached_tokens = len(prompt) - len(rest)
            if scores is None and self.tiers.caching:
                self.tiers.count(job, "memory")
            self._insert(job, rest, cache, scores)
        except Exception as exc:  # noqa: BLE001 - fail this request only (logged in _not_started)
            self._not_started(job, exc, outputs)
            return
        self._inserted(job)

    def _not_started(self, job: Job, exc: Exception, outputs: Outputs) -> None:
        """``job`` could not be admitted: it ends with an error; the others go on."""
        log.exception("admitting request failed")
        self.by_key.pop(job.key, None)
        outputs[job.key] = Delivery((StreamFailure(f"could not start generation: {exc}"),), True)

    def _disk_done(self, outputs: Outputs) -> None:
        """Insert the jobs whose disk read finished (see :meth:`.PrefixTiers.poll_disk`)."""
        for job, match, cache in self.tiers.poll_disk():
            self._admit_read(job, match, cache, outputs)

    def _admit_read(self, job: Job, match: DiskMatch, cache: list[Any] | None, outputs: Outputs) -> None:
        """Insert ``job``, which waited for ``match``'s entry: ``cache`` is its
        copy of it (None: the file failed, the memory tier serves)."""
        from mlx_lm.models.cache import trim_prompt_cache

        prompt = job.prompt
        try:
            if cache is None:
                cache, rest = self.tiers.fetch_memory(prompt, job.adapter)
                tier = "memory"
            else:
                keep = min(match.served, len(prompt) - 1)  # one prompt token is always computed
                trim_prompt_cache(cache, len(match.entry.tokens) - keep)
                rest = prompt[keep:]
                tier = "disk"
            job.cached_tokens = len(prompt) - len(rest)
            self.tiers.count(job, tier)
            self._insert(job, rest, cache, None)
        except Exception as exc:  # noqa: BLE001 - fail this request only (logged in _not_started)
            self._not_started(job, exc, outputs)
            return
        self._inserted(job)

    def _insert(self, job: Job, rest: list[int], cache: list[Any] | None, scores: PromptScores | None) -> None:
        """Insert ``job`` into mlx-lm's batch: ``rest`` is its prompt after
        ``cache`` (which holds the first ``job.cached_tokens`` tokens)."""
        from .sampling import GuardedProcessor, logits_processors

        req = job.request
        prompt = job.prompt
        procs = [GuardedProcessor(p) for p in logits_processors(req, vocab_size(self.model))]
        if job.grammar is not None:
            procs.append(GuardedProcessor(job.grammar))
        job.guards = procs
        inserted = self.gen.insert_one(
            rest,
            # a prompt scored for no token still runs one step: it ends there
            max_tokens=max(job.max_tokens, 1),
            cache=cache,
            all_tokens=prompt[: job.cached_tokens],
            sampler=self.samplers.get(req, vocab_size(self.model)),
            logits_processors=procs,
            stop_at_eos=job.stop_at_eos,
            scores=scores,
            adapter=job.adapter,
        )
        job.scores = scores
        job.uid = uid = MlxUid(inserted)
        self.by_uid[uid] = job
        if req.logprobs:
            self.logprob_uids.add(uid)
        self.by_key[job.key] = job
        self.stats.prompt_tokens += len(prompt)
        self.stats.computed_prompt_tokens += len(rest)
        self.stats.cached_tokens += job.cached_tokens

    def _inserted(self, job: Job) -> None:
        """``job`` is in mlx-lm's batch: later jobs with its prompt may park on
        it; its first progress event."""
        self.prefill.lead(job)
        if job.progress:
            self._progress(job, job.cached_tokens)

    def _start_followers(self, outputs: Outputs) -> None:
        """Insert the jobs parked on the leaders whose prefill just ended, each
        with a copy of its leader's cache (see :mod:`.shared_prefill`)."""
        prefilled = list(self.gen.prefilled.items())
        self.gen.prefilled.clear()
        for uid, row in prefilled:
            leader = self.by_uid.get(MlxUid(uid))
            if leader is None:
                continue
            followers = self.prefill.followers(leader)
            for n, job in enumerate(followers):
                cache = row if n == len(followers) - 1 else copy.deepcopy(row)
                job.cached_tokens = len(job.prompt) - 1
                try:
                    self._insert(job, job.prompt[-1:], cache, None)
                except Exception as exc:  # noqa: BLE001 - fail this request only (logged in _not_started)
                    self._not_started(job, exc, outputs)
                    continue
                self.stats.shared_prefills += 1
                self._inserted(job)

    def _readmit(self, outputs: Outputs) -> None:
        """Admit the parked jobs whose leader left before its prefill ended:
        the first one prefills, the others park on it."""
        while (job := self.prefill.orphan()) is not None:
            self._admit(job, outputs)

    def _progress(self, job: Job, processed: int) -> None:
        elapsed = (time.perf_counter() - job.t_admitted) * 1000.0
        event = PromptProgress(processed, len(job.prompt), job.cached_tokens, round(elapsed, 3))
        self.early.setdefault(job.key, []).append(event)

    def _flush_early(self, outputs: Outputs) -> None:
        """Put the progress events ahead of each stream's other events of this iteration."""
        for key, events in self.early.items():
            held = outputs.get(key)
            if held is not None:
                outputs[key] = held._replace(events=(*events, *held.events))
            elif key in self.by_key:
                outputs[key] = Delivery(tuple(events), False)
        self.early.clear()
