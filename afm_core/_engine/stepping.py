"""The engine step on the generation thread: run one step of mlx-lm's batch,
feed each new token through its stream's pipeline (stop strings, tools,
structured output, log-probabilities, ``max_tokens``), end the streams that
finished (``Finish``, ``Usage``, ``Profile``), and publish the counters.

**Speculative decoding.**  With ``prompt_lookup`` or a draft model the decode
batch may verify proposed tokens instead of taking a plain step
(:mod:`afm_core._mlx.speculative`; only while at most ``spec_max_batch``
streams decode): a stream may then get several tokens from one step, as
several responses of its uid, in order, each fed through its pipeline as a
plain step's token is (stop strings, ``max_tokens`` and the end of the stream
apply per token).  The per-stream counts go to its profile.

:class:`Stepping` is a part of :class:`~.worker.Worker` (its base class): the
state it uses is the worker's, declared below.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._stream.events import Event, Finish, Profile, StreamFailure, Usage
from .commands import Delivery, Job, JobKey, MlxUid, Outputs, PromptLogprobs
from .kv_memory import kv_bytes_per_token
from .logprobs import prompt_logprobs, token_logprobs

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.generate import GenerationBatch
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .._mlx.prefill import EngineBatchGenerator
    from .config import EngineConfig
    from .prefix_tiers import PrefixTiers
    from .shared_prefill import SharedPrefill
    from .stats import WorkerStats

log = logging.getLogger("afm.engine")


class Stepping:
    """The engine step (see the module docstring); a base class of the worker."""

    # the worker's state and steps this part uses (set and defined by Worker)
    mx: Any
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: EngineConfig
    gen: EngineBatchGenerator
    stats: WorkerStats
    tiers: PrefixTiers
    prefill: SharedPrefill
    by_key: dict[JobKey, Job]
    by_uid: dict[MlxUid, Job]
    scored: dict[JobKey, PromptLogprobs]
    eos: set[int]
    kv_half: bool | None
    weights_bytes: int
    device: str
    blas: str
    _remove: Callable[[Job], None]
    _forget: Callable[[Job], None]
    _reset_generator: Callable[[], None]
    _save_cache: Callable[..., None]
    _start_followers: Callable[[Outputs], None]
    _progress: Callable[[Job, int], None]

    def _step(self, outputs: Outputs) -> None:
        """One engine step: prefill chunks and decode tokens for every row; a
        failed step fails every stream and starts a fresh generator."""
        gen = self.gen
        try:
            prompt_responses, responses = gen.next()
        except Exception as exc:  # the batch is unusable: fail it, keep serving
            log.exception("engine step failed")
            for stale in list(self.by_key.values()):
                self._remove(stale)
                outputs[stale.key] = Delivery((StreamFailure(f"generation failed: {exc}"),), True)
            self._reset_generator()
            return
        self.stats.steps += 1
        if gen.prefilled:
            self._start_followers(outputs)
        self._prefill_chunks(prompt_responses)
        self._deliver(responses, outputs)
        if self.scored:
            for key, scored in self.scored.items():
                held = outputs.get(key)
                outputs[key] = held._replace(prompt_logprobs=scored) if held is not None \
                    else Delivery((), False, scored)
            self.scored.clear()

    def _prefill_chunks(self, prompt_responses: list[Any]) -> None:
        """The step's prefill chunks (mlx-lm's prompt responses): prefills that
        ended (no job parks on them any more) and prompt progress."""
        for p in prompt_responses:
            prefilling = self.by_uid.get(p.uid)
            if prefilling is None:
                continue
            if p.end_of_prompt:
                self.prefill.ended(prefilling)
            if prefilling.progress:
                done = len(prefilling.prompt) if p.end_of_prompt else prefilling.cached_tokens + p.progress[0]
                self._progress(prefilling, done)

    def _deliver(self, responses: list[Any], outputs: Outputs) -> None:
        """Feed each generated token through its stream (a failed grammar or
        prompt scoring, or a fault in the stream's pipeline, ends that stream only)."""
        now = time.perf_counter()
        # a verify step of speculative decoding answers several tokens of a row
        batch_size = len({r.uid for r in responses}) if self.gen.speculation is not None else len(responses)
        active = self.mx.get_active_memory() if any(j.profile for j in self.by_key.values()) else 0
        pending: dict[JobKey, list[Event]] = {}
        for r in responses:
            job = self.by_uid.get(r.uid)
            if job is None:
                continue
            events = pending.setdefault(job.key, [])
            failed = next((g.error for g in job.guards if g.error is not None), None)
            if failed is not None:
                self._remove(job)
                from .sampling import guard_failure  # (a grammar's failure is the client's)

                events.append(guard_failure(failed))
                outputs[job.key] = Delivery(tuple(events), True)
                continue
            if job.scores is not None and job.scores.error is not None:
                self._remove(job)
                events.append(StreamFailure(f"cannot score the prompt: {job.scores.error}",
                                            type="invalid_request_error", code="unsupported"))
                outputs[job.key] = Delivery(tuple(events), True)
                continue
            try:
                self._advance(job, r, events, outputs, now, batch_size, active)
            except Exception as exc:  # one stream's fault ends only that stream
                log.exception("stream processing failed")
                if job.uid is not None and job.uid in self.by_uid:
                    self._remove(job)
                events.append(StreamFailure(f"stream processing failed: {exc}"))
                outputs[job.key] = Delivery(tuple(events), True)
        for key, events in pending.items():
            if key not in outputs and events:
                outputs[key] = Delivery(tuple(events), False)

    def _advance(self, job: Job, r: GenerationBatch.Response, events: list[Event], outputs: Outputs, now: float,
                 batch_size: int, active: int) -> None:
        """Feed one generated token of ``job`` through its pipeline."""
        gen = self.gen
        if job.scores is not None:  # its prefill is over: the prompt is scored
            self.scored[job.key] = prompt_logprobs(self.tokenizer, job.prompt, job.scores)
            job.scores = None
        if job.max_tokens == 0:
            # admitted to score its prompt only: the token it had to sample is not its own
            if r.finish_reason is None:
                gen.remove([r.uid])
            self._forget(job)
            events.extend(self._end(job, "length"))
            outputs[job.key] = Delivery(tuple(events), True)
            return
        job.completion_tokens += 1
        self.stats.generation_tokens += 1
        reason = r.finish_reason
        stopped = False
        if not (reason == "stop" and r.token in self.eos):
            stopped = job.pipeline.feed_token(r.token, events)
            if job.request.logprobs:
                events.append(token_logprobs(self.tokenizer, r.token, r.logprobs, job.request.top_logprobs))
        if job.profile is not None:
            job.profile.step(now, job.completion_tokens, batch_size, active)
        if stopped and reason is None:
            reason = "stop"
            gen.remove([r.uid])
            self._forget(job)
        elif reason is not None:
            self._forget(job)
            if self.tiers.caching and r.prompt_cache is not None and r.all_tokens is not None:
                self._save_cache(r.all_tokens, r.prompt_cache, job.adapter, job.breakpoints)
        if reason is not None:
            if reason == "stop" and job.pipeline.saw_tool_call:
                reason = "tool_calls"
            events.extend(self._end(job, reason))
            outputs[job.key] = Delivery(tuple(events), True)

    def _update_stats(self) -> None:
        s, seen = self.stats, self.gen.occupancy()
        s.running = seen.decoding
        s.prefilling = seen.prefilling
        s.queued = seen.waiting
        s.parked = self.prefill.parked
        spec = self.gen.speculation
        if spec is not None:
            s.spec_steps, s.spec_proposed, s.spec_accepted = spec.steps, spec.proposed, spec.accepted
        c = self.tiers.counts
        s.prefix_cache_lookups, s.prefix_cache_hits, s.prefix_cache_bytes = c.lookups, c.hits, c.memory_bytes
        s.prefix_cache_memory_hits, s.prefix_cache_disk_hits = c.memory_hits, c.disk_hits
        s.prefix_cache_disk_misses = c.disk_misses
        if self.tiers.disk is not None:
            d = self.tiers.disk.stats
            s.prefix_cache_disk_bytes, s.prefix_cache_disk_entries = d.bytes, d.entries
            s.prefix_cache_disk_writes, s.prefix_cache_disk_written_bytes = d.writes, d.written_bytes
            s.prefix_cache_disk_read_bytes, s.prefix_cache_disk_evictions = d.read_bytes, d.evictions
            s.prefix_cache_disk_corrupt, s.prefix_cache_disk_dropped_writes = d.corrupt, d.dropped_writes

    def _end(self, job: Job, reason: str) -> list[Event]:
        events: list[Event] = []
        try:
            job.pipeline.finish(events)
        except Exception as exc:  # noqa: BLE001
            events.append(StreamFailure(f"stream processing failed: {exc}"))
            return events
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        events.append(Finish(reason))
        written = 0
        if job.breakpoints and self.tiers.caching:
            written = max(0, max(n for n, _ in job.breakpoints) - job.cached_tokens)
        usage = Usage(len(job.prompt), job.completion_tokens, job.cached_tokens, written)
        events.append(usage)
        if job.profile is not None:
            mx = self.mx
            per_token = kv_bytes_per_token(self.model, self.config.kv_bits, self.config.kv_group_size, half=bool(self.kv_half))
            kv = per_token * (len(job.prompt) + job.completion_tokens)
            payload = job.profile.payload(
                prompt_tokens=len(job.prompt),
                cached_tokens=job.cached_tokens,
                completion_tokens=job.completion_tokens,
                weights_bytes=self.weights_bytes,
                kv_bytes=kv,
                active_bytes=mx.get_active_memory(),
                peak_bytes=mx.get_peak_memory(),
                device=self.device,
                blas=self.blas,
                kv_bits=self.config.kv_bits,
            )
            events.append(Profile(payload, job.profile.extended))
        return events
