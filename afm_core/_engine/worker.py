"""The generation thread: the only code that touches MLX after loading.

It owns the model, mlx-lm's ``BatchGenerator`` and the prefix cache, and
runs every stream's token pipeline.  Trio talks to it through a queue of
commands (:mod:`.commands`: ``Submit`` / ``Cancel`` / ``Drop`` / ``Stop`` /
``Reset`` / ``Sync``, sent by the methods of the same names); it answers with
one ``post(outputs)`` per engine step, carrying every stream's new events.
Commands are drained before every step, so a cancelled or abandoned request
leaves the batch within one step, and a new one joins at the next.  Jobs are
named by their key on the way in and out, by mlx-lm's uid inside the batch
(see :mod:`.commands` for the id spaces).

**Shared prefill.**  Jobs with the same prompt prefill it once: a later one
parks on the job prefilling it and starts from a copy of its cache
(:mod:`.shared_prefill` keeps who leads and who is parked).

**Prompt progress.**  A job with ``progress`` gets
:class:`~afm_core._stream.events.PromptProgress` events: when it is inserted
(``processed`` = its cached tokens), for each prefill chunk (mlx-lm's prompt
responses), and ``processed == total`` when its prefill ends, the step
before its first token.

**The prefix cache's tiers.**  Finished requests' caches go to the memory
tier and, with ``cache_dir``, to the disk tier; admission asks both, and a
job whose prompt the disk tier serves waits, out of the batch, for its entry
to be read (:mod:`.prefix_tiers`).

**A request that leaves early** (cancelled, or dropped when its client
went away) keeps what it computed: its row's cache (the prefill's chunks so
far, or the prompt and the tokens generated) goes to the prefix cache's tiers
as a finished request's does, so a retry of the same prompt resumes where it
stopped (``kept_prefixes`` counts them; the retry's ``cached_tokens`` shows it).

**LoRA adapters.**  A job's ``adapter`` (0: none) goes with its row into
the generator (``insert_one(adapter=...)``; :mod:`afm_core._mlx.lora`), so
rows on different adapters decode in the same batch.  What a row computed
under one adapter never serves another: the memory tier's entries are keyed
by adapter (``PrefixTiers.key``), a job parks only on a leader with the same
adapter (``shared_prefill.share_key``), and the disk tier keys its entries by the
adapter's content (``lora.adapter_fingerprint``): an adapted conversation
survives eviction and restart as a base one does, and never serves another
adapter, the base model, or other weights under the same name.

**A quantized KV cache** (``kv_bits``): every row starts on a quantized
cache (``EngineBatchGenerator.new_cache``), so the batch, both tiers' entries
and the shared-prefill copies hold the same format; the disk tier's
fingerprint includes it (``kv_format``), so entries of another setting are
never read.

**Speculative decoding.**  With ``prompt_lookup`` or a draft model the
decode batch may verify proposed tokens instead of taking a plain step
(:mod:`afm_core._mlx.speculative`; only while at most ``spec_max_batch``
streams decode): a stream may then get several tokens from one step, as
several responses of its uid, in order, each fed through its pipeline as a
plain step's token is (stop strings, ``max_tokens`` and the end of the
stream apply per token).  The per-stream counts go to its profile.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._stream.events import Event, Finish, Profile, PromptProgress, StreamFailure, Usage
from .commands import (
    Cancel,
    Command,
    Delivery,
    Drop,
    Embed,
    Job,
    JobKey,
    MlxUid,
    Outputs,
    PromptLogprobs,
    Reset,
    Stop,
    Submit,
    Sync,
)
from .kv_memory import (
    PROBE_TEXT,
    default_prefix_budget,
    kv_bytes_per_token,
    param_bytes,
    vocab_size,
)
from .logprobs import prompt_logprobs, token_logprobs
from .prefix_tiers import PrefixTiers
from .shared_prefill import SharedPrefill
from .stats import WorkerStats

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.generate import GenerationBatch
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .._mlx.disk_cache import DiskMatch, DiskPromptCache
    from .._mlx.lora import AdapterRows
    from .._mlx.prefill import EngineBatchGenerator, PromptScores
    from .._mlx.prefix_cache import PinningPromptCache
    from .._mlx.speculative import Speculation
    from .config import EngineConfig
    from .sampling import SamplerCache
    from .shared_prefill import ShareKey

log = logging.getLogger("afm.engine")

class Worker:
    """Runs in its own thread; see the module docstring."""

    def __init__(self, model: nn.Module, tokenizer: TokenizerWrapper, *, post: Callable[[Outputs], None],
                 config: EngineConfig, model_key: str, adapters: AdapterRows | None = None,
                 draft: nn.Module | None = None):
        """``config``: the engine's settings (the batch, the prefill, the prefix
        cache's tiers, the KV cache, speculative decoding, embeddings);
        ``model_key``: the model's path, naming its prefix cache entries;
        ``adapters``: the LoRA adapters attached to ``model``; ``draft``: the
        draft model of speculative decoding, if one is used."""
        self.model = model
        self.tokenizer = tokenizer
        self.post = post
        self.config = config
        self.model_key = model_key
        self.adapters = adapters
        self.draft = draft
        self.kv_half: bool | None = None  # decided once, at the first setup
        # the prefix cache's memory and disk tiers (and the jobs waiting for a disk read)
        self.tiers = PrefixTiers(model_key, config.prefix_cache_bytes or 0, active=lambda: self.gen.prompt_cache_nbytes)
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.stats = WorkerStats()
        self.by_uid: dict[MlxUid, Job] = {}  # admitted jobs, by mlx-lm's uid
        self.logprob_uids: set[int] = set()  # uids of the rows whose log-probabilities are read
        self.by_key: dict[JobKey, Job] = {}  # every job the thread holds, by the engine's key
        self.scored: dict[JobKey, PromptLogprobs] = {}  # prompts scored this step, to deliver
        self.synced: list[Callable[[], None]] = []  # Sync callbacks due after this iteration's step
        self.prefill = SharedPrefill(lambda: self.gen.shared)  # jobs sharing a prompt's prefill
        self.early: dict[JobKey, list[Event]] = {}  # progress events, ahead of the step's others
        self.thread: threading.Thread | None = None
        self.fatal: BaseException | None = None

    # -- called from other threads (each puts one command, see .commands) ------

    def submit(self, job: Job) -> None:
        self.commands.put(Submit(job))

    def cancel(self, key: JobKey) -> None:
        """End ``key`` with finish_reason ``cancelled`` (events are posted)."""
        self.commands.put(Cancel(key))

    def drop(self, key: JobKey) -> None:
        """Forget ``key`` silently (its consumer is gone)."""
        self.commands.put(Drop(key))

    def stop(self) -> None:
        self.commands.put(Stop())

    def reset(self, done: Callable[[], None]) -> None:
        """Zero the counters and empty the prefix cache, then call ``done``
        (on the generation thread); used after the start-up warm-up."""
        self.commands.put(Reset(done))

    def sync(self, done: Callable[[], None]) -> None:
        """Call ``done`` (on the generation thread) after the step that
        follows every command sent so far (see :class:`.commands.Sync`)."""
        self.commands.put(Sync(done))

    def embed(self, cmd: Embed) -> None:
        """Compute embeddings between two steps (see :class:`.commands.Embed`)."""
        self.commands.put(cmd)

    # -- the thread ----------------------------------------------------------

    def setup(self) -> None:
        """Create the MLX objects; must run on the generation thread."""
        import mlx.core as mx

        from .._mlx.prefill import EngineBatchGenerator
        from .sampling import SamplerCache

        self.mx = mx
        self.stream = mx.new_stream(mx.default_device())
        self._resolve_memory()
        eos = sorted(self.tokenizer.eos_token_ids)
        self.gen: EngineBatchGenerator = EngineBatchGenerator(
            self.model,
            logprob_uids=self.logprob_uids,
            adapters=self.adapters,
            speculation=self._speculation(),
            max_tokens=1 << 30,
            stop_tokens=[[t] for t in eos],
            completion_batch_size=self.config.max_batch,
            # mlx-lm widens the decode batch to the prefill batch: keep it within max_batch
            prefill_batch_size=min(self.config.prefill_batch, self.config.max_batch),
            prefill_step_size=self.config.prefill_step,
            prefill_step_decoding=self.config.prefill_step_decoding,
            stream=self.stream,
            kv_bits=self.config.kv_bits,
            kv_group_size=self.config.kv_group_size,
            kv_half=bool(self.kv_half),
        )
        self.tiers.memory = self._new_prefix_cache()
        if self.config.cache_dir is not None:
            from .._mlx.disk_cache import model_fingerprint

            self.tiers.open_disk(self.config.cache_dir, self.config.cache_disk_bytes, model_fingerprint(self.model_key, self.kv_format),
                                 wake=self._wake,
                                 adapters=self.adapters.fingerprints if self.adapters is not None else ())
        self.samplers: SamplerCache = SamplerCache()
        from .embed_steps import EmbeddingSteps

        self.embeddings = EmbeddingSteps(self.model, mx, self.stream, self.config.embedding_step)
        self.eos = set(eos)
        if self.adapters is not None:
            self.adapters.of.clear()  # (a generator made again after a failed step)
        self.weights_bytes = param_bytes(self.model)
        self.device = str(mx.default_device()).split("(")[-1].split(",")[0].replace("DeviceType.", "")
        from .._mlx.blas import confirm

        self.blas = confirm().name

    def _resolve_memory(self) -> None:
        """Once per worker: the KV cache's element type (``kv_dtype``; ``auto``
        probes the model, see ``afm_core._mlx.half_cache``) and, when not
        given, the prefix cache's budget: the KV cache of one request filling
        the model's context, at most ``kv_memory.PREFIX_CACHE_CAP``."""
        if self.kv_half is not None:
            return
        from .._mlx.half_cache import fits_half

        if self.config.kv_bits is not None or self.config.kv_dtype == "model":
            self.kv_half = False
        elif self.config.kv_dtype == "float16":
            self.kv_half = True
        else:
            with self.mx.stream(self.stream):
                self.kv_half = fits_half(self.model, list(self.tokenizer.encode(PROBE_TEXT)))
            self.mx.clear_cache()
        if self.config.prefix_cache_bytes is None:
            self.prefix_cache_bytes = default_prefix_budget(self.model, self.config.kv_bits, self.config.kv_group_size,
                                                            bool(self.kv_half))
        log.info("KV cache: %s; prefix cache budget %d MiB", self.kv_description,
                 self.prefix_cache_bytes >> 20)

    @property
    def kv_description(self) -> str:
        """``float16``, ``float32`` (the model's type) or e.g. ``8-bit (groups of 64)``."""
        if self.config.kv_bits is not None:
            return f"{self.config.kv_bits}-bit (groups of {self.config.kv_group_size})"
        return "float16" if self.kv_half else "the model's type"

    def _speculation(self) -> Speculation | None:
        """The decode batch's speculative decoding (a draft model if given, else
        prompt lookup), or None."""
        from .._mlx.speculative import DraftModel, PromptLookup, Proposer, Speculation

        if self.config.spec_max_batch <= 0:
            return None
        proposer: Proposer
        if self.draft is not None and self.config.draft_tokens > 0:
            proposer, k = DraftModel(self.draft), self.config.draft_tokens
        elif self.config.prompt_lookup > 0:
            proposer, k = PromptLookup(), self.config.prompt_lookup
        else:
            return None
        return Speculation(proposer, tokens=k, max_batch=self.config.spec_max_batch)

    def _wake(self) -> None:
        """(From the disk tier's I/O thread.)  Some disk work is done: an idle
        loop wakes up to collect it."""
        self.commands.put(Sync(_nothing))

    @property
    def kv_format(self) -> str:
        """The KV cache's format, ``""`` (the model's float type), ``"f16"`` or
        e.g. ``"q8g64"`` (see ``model_fingerprint``)."""
        if self.config.kv_bits is not None:
            return f"q{self.config.kv_bits}g{self.config.kv_group_size}"
        return "f16" if self.kv_half else ""

    # -- the parts' state, by the names the worker had ---------------------------

    @property
    def prefix_cache(self) -> PinningPromptCache:
        """The prefix cache's memory tier."""
        return self.tiers.memory

    @property
    def prefix_cache_bytes(self) -> int:
        """The memory tier's budget (bytes; 0: no memory tier)."""
        return self.tiers.budget

    @prefix_cache_bytes.setter
    def prefix_cache_bytes(self, value: int) -> None:
        self.tiers.budget = value

    @property
    def disk(self) -> DiskPromptCache | None:
        return self.tiers.disk

    @property
    def loading(self) -> dict[JobKey, tuple[Job, DiskMatch]]:
        """Jobs waiting for a disk read."""
        return self.tiers.loading

    @property
    def leaders(self) -> dict[ShareKey, Job]:
        return self.prefill.leaders

    @property
    def leading(self) -> dict[JobKey, ShareKey]:
        return self.prefill.leading

    @property
    def orphans(self) -> dict[JobKey, Job]:
        return self.prefill.orphans

    @property
    def caching(self) -> bool:
        """Whether finished requests' caches are kept (in either tier)."""
        return self.tiers.caching

    def _new_prefix_cache(self) -> PinningPromptCache:
        from .._mlx.prefix_cache import make_prefix_cache

        return make_prefix_cache(max_size=256, max_bytes=max(self.prefix_cache_bytes, 0))

    def run_failed(self, exc: BaseException) -> None:
        """The loop died: end every stream with an error chunk."""
        log.error("generation thread died: %s", "".join(traceback.format_exception(exc)))
        outputs: Outputs = {}
        for job in self.by_key.values():
            err = StreamFailure(f"generation failed: {exc}", code="generation_failed")
            outputs[job.key] = Delivery((err,), True)
        self.by_key.clear()
        self.by_uid.clear()
        self.tiers.loading.clear()
        if outputs:
            self.post(outputs)
        if self.tiers.disk is not None:
            try:
                self.tiers.close()  # the writes already queued still land
            except Exception:  # the thread's failure is what is reported
                log.exception("closing the prefix cache's disk tier failed")

    def loop(self) -> None:
        """The generation loop; returns after a ``stop`` command."""
        while True:
            busy = len(self.by_key) > len(self.tiers.loading) or bool(self.embeddings)
            # (a job waiting for a disk read needs no step)
            try:
                cmd = self.commands.get(block=not busy)
            except queue.Empty:
                cmd = None
            outputs: Outputs = {}
            while cmd is not None:
                if isinstance(cmd, Stop):
                    self._shutdown(outputs)
                    if outputs:
                        self.post(outputs)
                    self._run_synced()
                    return
                self._command(cmd, outputs)
                try:
                    cmd = self.commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.tiers.disk is not None:
                self._disk_done(outputs)
            self._readmit(outputs)
            if len(self.by_key) > len(self.tiers.loading):
                self._step(outputs)
                self._readmit(outputs)
            if self.embeddings:
                self.embeddings.step()  # one slice between two decode steps
            self._update_stats()
            if self.early:
                self._flush_early(outputs)
            if outputs:
                self.post(outputs)
            if self.synced:
                self._run_synced()

    def _run_synced(self) -> None:
        synced, self.synced = self.synced, []
        for done in synced:
            done()

    def _command(self, cmd: Command, outputs: Outputs) -> None:
        match cmd:
            case Submit(job):
                self._admit(job, outputs)
            case Reset(done):
                self.stats = WorkerStats()
                spec = self.gen.speculation
                if spec is not None:
                    spec.steps = spec.proposed = spec.accepted = 0
                self.tiers.reset(self._new_prefix_cache())
                self._update_stats()
                done()
            case Sync(done):
                self.synced.append(done)
            case Embed():
                self._embed(cmd)
            case Cancel(key) | Drop(key):
                held = self.by_key.get(key)
                if held is None:
                    return
                self._keep_prefix(held)
                self._remove(held)
                if isinstance(cmd, Cancel):
                    outputs[held.key] = Delivery(tuple(self._end(held, "cancelled")), True)
                else:
                    self.early.pop(held.key, None)
            case Stop():  # the loop handles it before calling here
                raise AssertionError("Stop reaches _command")

    def _embed(self, cmd: Embed) -> None:
        """Keep ``cmd``: :class:`.embed_steps.EmbeddingSteps` computes it a slice
        at a time after each decode step (``loop``)."""
        if not cmd.abandoned.is_set():
            self.embeddings.add(cmd)

    def _admit(self, job: Job, outputs: Outputs) -> None:
        """Insert ``job`` into mlx-lm's batch, or park it on the job prefilling
        its prompt (see the module docstring)."""
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
            if self.caching and scores is None:
                self.tiers.counts.lookups += 1
                if self.tiers.read_disk(job):
                    self.by_key[job.key] = job
                    return  # admitted when its entry has been read (_disk_done)
                cache, rest = self.tiers.fetch_memory(prompt, job.adapter)
            job.cached_tokens = len(prompt) - len(rest)
            if scores is None and self.caching:
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

    def _step(self, outputs: Outputs) -> None:
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
        for p in prompt_responses:
            prefilling = self.by_uid.get(p.uid)
            if prefilling is None:
                continue
            if p.end_of_prompt:
                self.prefill.ended(prefilling)
            if prefilling.progress:
                done = len(prefilling.prompt) if p.end_of_prompt else prefilling.cached_tokens + p.progress[0]
                self._progress(prefilling, done)
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
        if self.scored:
            for key, scored in self.scored.items():
                held = outputs.get(key)
                outputs[key] = held._replace(prompt_logprobs=scored) if held is not None \
                    else Delivery((), False, scored)
            self.scored.clear()

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
            if self.caching and r.prompt_cache is not None and r.all_tokens is not None:
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
        if job.breakpoints and self.caching:
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

    def _keep_prefix(self, job: Job) -> None:
        """``job`` leaves before it ends (cancelled, or its client went away):
        what it computed beyond the cache it started from (a prefill stopped
        part-way, or a prompt and some output) goes to the prefix cache, so a
        retry of the same prompt resumes there instead of starting over."""
        if not self.caching or job.uid is None or job.scores is not None:
            return
        found = self.gen.extract_cache([job.uid]).get(job.uid)
        if found is None:
            return
        cache, tokens = found
        if cache is None or tokens is None or len(tokens) <= job.cached_tokens:
            return  # still waiting to start: nothing new
        self.stats.kept_prefixes += 1
        self._save_cache(list(tokens), cache, job.adapter)

    def _remove(self, job: Job) -> None:
        if job.uid is not None:
            self.gen.remove([job.uid])
        self._forget(job)

    def _forget(self, job: Job) -> None:
        spec = self.gen.speculation
        if job.uid is not None and spec is not None:
            counts = spec.take(job.uid)
            if job.profile is not None:
                job.profile.spec = counts
        if job.uid is not None:
            self.by_uid.pop(job.uid, None)
            self.logprob_uids.discard(job.uid)
            self.gen.forget_scores(job.uid)
            self.gen.prefilled.pop(job.uid, None)
        self.tiers.loading.pop(job.key, None)
        self.prefill.leave(job)  # (a leader leaving hands its parked jobs back to admission)
        self.by_key.pop(job.key, None)

    def _save_cache(self, tokens: list[int], cache: list[Any], adapter: int = 0,
                    pins: tuple[tuple[int, float], ...] = ()) -> None:
        """Keep a row's cache in the prefix cache's tiers (:meth:`.PrefixTiers.save`)."""
        self.tiers.save(tokens, cache, adapter, pins)

    def _reset_generator(self) -> None:
        self.gen.close()
        # a step that failed inside mlx-lm's compiled sampler can leave the global
        # PRNG state unevaluable; start it afresh with the generator
        self.mx.random.seed(time.time_ns() % (2**32))
        self.logprob_uids.clear()
        self.setup()

    def _shutdown(self, outputs: Outputs) -> None:
        for job in list(self.by_key.values()):
            self._remove(job)
            outputs[job.key] = Delivery((StreamFailure("the engine is shutting down", code="engine_closed"),), True)
        self.gen.close()
        self.tiers.close()  # the queued writes are finished first


def _nothing() -> None:
    pass


