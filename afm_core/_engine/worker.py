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

**Shared prefill.**  A job whose prompt (the same token ids) is being
prefilled for another job still waiting or prefilling in the batch is not
prefilled again: it is *parked* on that job, its *leader* (held in
``by_key``, with no uid).  When the leader's prefill ends, the generator
leaves a deep copy of the leader's cache (every prompt token but the last) in
``gen.prefilled`` (see :mod:`afm_core._mlx.prefill`), and after the step
each parked job is inserted with its own copy and only its last prompt
token left to compute (``cached_tokens`` ``len(prompt) - 1``).  A leader
that leaves before its prefill ends (cancelled, dropped, failed) hands its
parked jobs back to admission: the first one prefills, the others park on it.
Jobs scoring their prompt (``prompt_top_logprobs``) neither lead nor park.

**Prompt progress.**  A job with ``progress`` gets
:class:`~afm_core._stream.events.PromptProgress` events: when it is inserted
(``processed`` = its cached tokens), for each prefill chunk (mlx-lm's prompt
responses), and ``processed == total`` when its prefill ends, the step
before its first token.

**The prefix cache's tiers.**  Finished requests' caches go to the memory
tier (mlx-lm's ``LRUPromptCache``) and, with ``cache_dir``, to the disk tier
too (:class:`~afm_core._mlx.disk_cache.DiskPromptCache`, written in the
background: write-through, so what a killed process had served is on disk
but for the writes under way).  Admission asks both how much of the prompt
they hold; the memory tier serves unless the disk tier holds enough more
(``_DISK_GAIN``), in which case the job waits, out of the batch, for its
entry to be read (by the disk tier's I/O thread, while the batch keeps
decoding; ``loading``); the entry then moves into the memory tier and the
job is inserted with its copy.  A file that turns out corrupt is deleted and
the job falls back to the memory tier's answer.

**A request that leaves early** (cancelled, or dropped when its client
went away) keeps what it computed: its row's cache (the prefill's chunks so
far, or the prompt and the tokens generated) goes to the prefix cache's tiers
as a finished request's does, so a retry of the same prompt resumes where it
stopped (``kept_prefixes`` counts them; the retry's ``cached_tokens`` shows it).

**LoRA adapters.**  A job's ``adapter`` (0: none) goes with its row into
the generator (``insert_one(adapter=...)``; :mod:`afm_core._mlx.lora`), so
rows on different adapters decode in the same batch.  What a row computed
under one adapter never serves another: the memory tier's entries are keyed
by adapter (``_cache_key``), a job parks only on a leader with the same
adapter (``_share_key``), and the disk tier keys its entries by the
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
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._stream.events import (
    Event,
    Finish,
    LogprobsDelta,
    Profile,
    PromptProgress,
    StreamFailure,
    TokenLogprob,
    TopLogprob,
    Usage,
)
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

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.generate import GenerationBatch
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .._mlx.disk_cache import DiskMatch, DiskPromptCache
    from .._mlx.lora import AdapterRows
    from .._mlx.prefill import EngineBatchGenerator, PromptScores
    from .._mlx.prefix_cache import PinningPromptCache
    from .._mlx.speculative import Speculation
    from .sampling import SamplerCache

log = logging.getLogger("afm.engine")

PREFIX_CACHE_CAP = 1 << 30
"""The most the prefix cache's memory tier keeps when its budget is sized to the model."""

_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Numbers: 3.14159, 2718, -42.\n"
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Traduis en français : « bonjour », 日本語のテキスト, {\"key\": [1, 2, 3]}"
)
"""Text whose keys and values ``kv_dtype="auto"`` checks against float16's range."""

_DISK_GAIN = 4
"""The disk tier serves a prompt when the tokens it holds beyond the memory
tier's answer, times this, reach its entry's length: reading an entry costs
about its length (reading KV is many times faster than computing it), so a
small gain from a long entry (a chat template's first tokens, shared with a
long conversation) is not worth reading it."""


@dataclass
class WorkerStats:
    """Counters the thread updates and the engine reads (ints: atomic enough)."""

    running: int = 0
    prefilling: int = 0
    queued: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_lookups: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_memory_hits: int = 0
    prefix_cache_disk_hits: int = 0
    """Lookups served by the disk tier (each also a hit and a memory miss)."""
    prefix_cache_disk_misses: int = 0
    """Lookups neither tier served, with a disk tier."""
    prefix_cache_disk_bytes: int = 0
    prefix_cache_disk_entries: int = 0
    prefix_cache_disk_writes: int = 0
    prefix_cache_disk_written_bytes: int = 0
    prefix_cache_disk_read_bytes: int = 0
    prefix_cache_disk_evictions: int = 0
    prefix_cache_disk_corrupt: int = 0
    prefix_cache_disk_dropped_writes: int = 0
    kept_prefixes: int = 0
    """Caches of requests cancelled or dropped before they ended, kept in the
    prefix cache (their prefill so far, or their prompt and output)."""
    shared_prefills: int = 0
    """Jobs started from another job's prefill of the same prompt (see the module docstring)."""
    parked: int = 0
    """Jobs waiting now for another job's prefill of the same prompt."""
    spec_steps: int = 0
    """Verify steps of speculative decoding (see :mod:`afm_core._mlx.speculative`)."""
    spec_proposed: int = 0
    """Tokens proposed to them (prompt lookup or the draft model)."""
    spec_accepted: int = 0
    """Of those, tokens the model agreed with (emitted without a step of their own)."""
    finished: dict[str, int] = field(default_factory=dict)


class Worker:
    """Runs in its own thread; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        *,
        post: Callable[[Outputs], None],
        max_batch: int,
        prefill_batch: int,
        prefill_step: int,
        prefix_cache_bytes: int | None,
        prefill_step_decoding: int = 0,
        kv_dtype: str = "model",
        model_key: str,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_disk_bytes: int = 0,
        adapters: AdapterRows | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        prompt_lookup: int = 0,
        draft: nn.Module | None = None,
        draft_tokens: int = 0,
        spec_max_batch: int = 0,
        embedding_step: int = 512,
    ):
        self.model = model
        self.embedding_step = embedding_step
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.post = post
        self.max_batch = max_batch
        self.prefill_batch = prefill_batch
        self.prefill_step = prefill_step
        self.prefill_step_decoding = prefill_step_decoding
        self.prefix_cache_budget = prefix_cache_bytes  # None: sized to the model at setup
        self.prefix_cache_bytes = prefix_cache_bytes if prefix_cache_bytes is not None else 0
        self.kv_dtype = kv_dtype
        self.kv_half: bool | None = None  # decided once, at the first setup
        self.model_key = model_key
        self.cache_dir = cache_dir
        self.cache_disk_bytes = cache_disk_bytes
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.prompt_lookup = prompt_lookup
        self.draft = draft
        self.draft_tokens = draft_tokens
        self.spec_max_batch = spec_max_batch
        self.disk: DiskPromptCache | None = None
        self.loading: dict[JobKey, tuple[Job, DiskMatch]] = {}  # jobs waiting for a disk read
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.stats = WorkerStats()
        self.by_uid: dict[MlxUid, Job] = {}  # admitted jobs, by mlx-lm's uid
        self.logprob_uids: set[int] = set()  # uids of the rows whose log-probabilities are read
        self.by_key: dict[JobKey, Job] = {}  # every job the thread holds, by the engine's key
        self.scored: dict[JobKey, PromptLogprobs] = {}  # prompts scored this step, to deliver
        self.synced: list[Callable[[], None]] = []  # Sync callbacks due after this iteration's step
        # shared prefill (see the module docstring)
        self.leaders: dict[tuple[int, ...], Job] = {}  # a prompt -> the job prefilling it
        self.leading: dict[JobKey, tuple[int, ...]] = {}  # the same, by the leader's key
        self.orphans: dict[JobKey, Job] = {}  # parked jobs whose leader left: admitted again
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
            completion_batch_size=self.max_batch,
            # mlx-lm widens the decode batch to the prefill batch: keep it within max_batch
            prefill_batch_size=min(self.prefill_batch, self.max_batch),
            prefill_step_size=self.prefill_step,
            prefill_step_decoding=self.prefill_step_decoding,
            stream=self.stream,
            kv_bits=self.kv_bits,
            kv_group_size=self.kv_group_size,
            kv_half=bool(self.kv_half),
        )
        self.prefix_cache: PinningPromptCache = self._new_prefix_cache()
        if self.cache_dir is not None and self.disk is None:
            from .._mlx.disk_cache import DiskPromptCache, model_fingerprint

            self.disk = DiskPromptCache(self.cache_dir, self.cache_disk_bytes, model_fingerprint(self.model_key, self.kv_format),
                                        wake=self._wake,
                                        adapters=self.adapters.fingerprints if self.adapters is not None else ())
        self.samplers: SamplerCache = SamplerCache()
        from .embed_steps import EmbeddingSteps

        self.embeddings = EmbeddingSteps(self.model, mx, self.stream, self.embedding_step)
        self.eos = set(eos)
        if self.adapters is not None:
            self.adapters.of.clear()  # (a generator made again after a failed step)
        self.weights_bytes = _param_bytes(self.model)
        self.device = str(mx.default_device()).split("(")[-1].split(",")[0].replace("DeviceType.", "")
        from .._mlx.blas import confirm

        self.blas = confirm().name

    def _resolve_memory(self) -> None:
        """Once per worker: the KV cache's element type (``kv_dtype``; ``auto``
        probes the model, see ``afm_core._mlx.half_cache``) and, when not
        given, the prefix cache's budget: the KV cache of one request filling
        the model's context, at most ``PREFIX_CACHE_CAP``."""
        if self.kv_half is not None:
            return
        from .._mlx.half_cache import fits_half

        if self.kv_bits is not None or self.kv_dtype == "model":
            self.kv_half = False
        elif self.kv_dtype == "float16":
            self.kv_half = True
        else:
            with self.mx.stream(self.stream):
                self.kv_half = fits_half(self.model, list(self.tokenizer.encode(_PROBE_TEXT)))
            self.mx.clear_cache()
        if self.prefix_cache_budget is None:
            context = _context_length(self.model)
            per_token = _kv_bytes_per_token(self.model, self.kv_bits, self.kv_group_size,
                                            half=bool(self.kv_half))
            self.prefix_cache_bytes = min(PREFIX_CACHE_CAP, per_token * context) if per_token and context \
                else PREFIX_CACHE_CAP
        log.info("KV cache: %s; prefix cache budget %d MiB", self.kv_description,
                 self.prefix_cache_bytes >> 20)

    @property
    def kv_description(self) -> str:
        """``float16``, ``float32`` (the model's type) or e.g. ``8-bit (groups of 64)``."""
        if self.kv_bits is not None:
            return f"{self.kv_bits}-bit (groups of {self.kv_group_size})"
        return "float16" if self.kv_half else "the model's type"

    def _speculation(self) -> Speculation | None:
        """The decode batch's speculative decoding (a draft model if given, else
        prompt lookup), or None."""
        from .._mlx.speculative import DraftModel, PromptLookup, Proposer, Speculation

        if self.spec_max_batch <= 0:
            return None
        proposer: Proposer
        if self.draft is not None and self.draft_tokens > 0:
            proposer, k = DraftModel(self.draft), self.draft_tokens
        elif self.prompt_lookup > 0:
            proposer, k = PromptLookup(), self.prompt_lookup
        else:
            return None
        return Speculation(proposer, tokens=k, max_batch=self.spec_max_batch)

    def _wake(self) -> None:
        """(From the disk tier's I/O thread.)  Some disk work is done: an idle
        loop wakes up to collect it."""
        self.commands.put(Sync(_nothing))

    @property
    def kv_format(self) -> str:
        """The KV cache's format, ``""`` (the model's float type), ``"f16"`` or
        e.g. ``"q8g64"`` (see ``model_fingerprint``)."""
        if self.kv_bits is not None:
            return f"q{self.kv_bits}g{self.kv_group_size}"
        return "f16" if self.kv_half else ""

    @property
    def caching(self) -> bool:
        """Whether finished requests' caches are kept (in either tier)."""
        return self.prefix_cache_bytes > 0 or self.disk is not None

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
        self.loading.clear()
        if outputs:
            self.post(outputs)
        if self.disk is not None:
            try:
                self.disk.close()  # the writes already queued still land
            except Exception:  # the thread's failure is what is reported
                log.exception("closing the prefix cache's disk tier failed")

    def loop(self) -> None:
        """The generation loop; returns after a ``stop`` command."""
        while True:
            busy = len(self.by_key) > len(self.loading) or bool(self.embeddings)
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
            if self.disk is not None:
                self._disk_done(outputs)
            self._readmit(outputs)
            if len(self.by_key) > len(self.loading):
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
                self.prefix_cache = self._new_prefix_cache()
                if self.disk is not None:
                    self.disk.reset()
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
        leader = self.leaders.get(key) if (key := _share_key(job)) is not None else None
        if leader is not None and leader.uid is not None:
            job.leader = leader
            leader.followers.append(job)
            self.gen.shared.add(leader.uid)
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
                self.stats.prefix_cache_lookups += 1
                if self._read_disk(job):
                    return  # admitted when its entry has been read (_disk_done)
                cache, rest = self._fetch_memory(prompt, self._cache_key(job.adapter))
            job.cached_tokens = len(prompt) - len(rest)
            if scores is None and self.caching:
                self._count_lookup(job, "memory")
            self._insert(job, rest, cache, scores)
        except Exception as exc:  # noqa: BLE001 - fail this request only (logged in _not_started)
            self._not_started(job, exc, outputs)
            return
        self._inserted(job, key)

    def _not_started(self, job: Job, exc: Exception, outputs: Outputs) -> None:
        """``job`` could not be admitted: it ends with an error; the others go on."""
        log.exception("admitting request failed")
        self.by_key.pop(job.key, None)
        outputs[job.key] = Delivery((StreamFailure(f"could not start generation: {exc}"),), True)

    def _cache_key(self, adapter: int) -> str:
        """The prefix cache's model key for rows on ``adapter`` (a cache computed
        under one adapter never serves another)."""
        return self.model_key if not adapter else f"{self.model_key}\0adapter:{adapter}"

    def _fetch_memory(self, prompt: list[int], model_key: str | None = None) -> tuple[list[Any] | None, list[int]]:
        """The memory tier's cache for ``prompt`` (a copy) under ``model_key``
        (default: the base model's) and the tokens it leaves to compute."""
        from mlx_lm.models.cache import trim_prompt_cache

        if self.prefix_cache_bytes <= 0:
            return None, prompt
        cache, rest = self.prefix_cache.fetch_nearest_cache(model_key or self.model_key, prompt)
        if cache is None:
            return None, prompt
        if not rest:
            # exact hit: recompute the last token so generation has an input
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        return cache, rest

    def _count_lookup(self, job: Job, tier: str) -> None:
        """Count ``job``'s lookup as served by ``tier`` if it got cached tokens, else as a miss."""
        s = self.stats
        if not job.cached_tokens:
            if self.disk is not None:
                s.prefix_cache_disk_misses += 1
            return
        s.prefix_cache_hits += 1
        if tier == "disk":
            s.prefix_cache_disk_hits += 1
        else:
            s.prefix_cache_memory_hits += 1
        if job.profile is not None:
            job.profile.prefix_tier = tier

    def _read_disk(self, job: Job) -> bool:
        """Start reading the disk tier's entry for ``job`` if it holds enough
        more of the prompt than the memory tier (see ``_DISK_GAIN``); True if
        the job now waits for it."""
        from .._mlx.prefix_cache import memory_served

        disk = self.disk
        if disk is None:
            return False
        prompt = job.prompt
        match = disk.nearest(prompt, job.adapter)  # (entries computed under the job's adapter only)
        if match is None:
            return False
        served = min(match.served, len(prompt) - 1)
        in_memory = 0
        if self.prefix_cache_bytes > 0:
            in_memory = min(memory_served(self.prefix_cache, self._cache_key(job.adapter), prompt), len(prompt) - 1)
        gain = served - in_memory
        if gain <= 0 or gain * _DISK_GAIN < len(match.entry.tokens):
            return False
        disk.load(match.entry)
        self.loading[job.key] = (job, match)
        self.by_key[job.key] = job
        return True

    def _disk_done(self, outputs: Outputs) -> None:
        """Collect the disk tier's finished work: each entry read moves into the
        memory tier, and the jobs waiting for it are inserted with a copy (or,
        if the file failed, with the memory tier's answer)."""
        assert self.disk is not None
        for loaded in self.disk.poll():
            waiting = [(job, match) for job, match in self.loading.values() if match.entry is loaded.entry]
            for job, _ in waiting:
                del self.loading[job.key]
            cache = loaded.cache
            promoted = cache is not None and self.prefix_cache_bytes > 0
            if promoted:
                assert cache is not None
                self.prefix_cache.insert_cache(self._cache_key(loaded.entry.adapter), list(loaded.entry.tokens), cache)
                self._trim_memory()
            for n, (job, match) in enumerate(waiting):
                mine = None
                if cache is not None:
                    mine = cache if not promoted and n == len(waiting) - 1 else copy.deepcopy(cache)
                self._admit_read(job, match, mine, outputs)

    def _admit_read(self, job: Job, match: DiskMatch, cache: list[Any] | None, outputs: Outputs) -> None:
        """Insert ``job``, which waited for ``match``'s entry: ``cache`` is its
        copy of it (None: the file failed, the memory tier serves)."""
        from mlx_lm.models.cache import trim_prompt_cache

        prompt = job.prompt
        try:
            if cache is None:
                cache, rest = self._fetch_memory(prompt, self._cache_key(job.adapter))
                tier = "memory"
            else:
                keep = min(match.served, len(prompt) - 1)  # one prompt token is always computed
                trim_prompt_cache(cache, len(match.entry.tokens) - keep)
                rest = prompt[keep:]
                tier = "disk"
            job.cached_tokens = len(prompt) - len(rest)
            self._count_lookup(job, tier)
            self._insert(job, rest, cache, None)
        except Exception as exc:  # noqa: BLE001 - fail this request only (logged in _not_started)
            self._not_started(job, exc, outputs)
            return
        self._inserted(job, _share_key(job))

    def _insert(self, job: Job, rest: list[int], cache: list[Any] | None, scores: PromptScores | None) -> None:
        """Insert ``job`` into mlx-lm's batch: ``rest`` is its prompt after
        ``cache`` (which holds the first ``job.cached_tokens`` tokens)."""
        from .sampling import GuardedProcessor, logits_processors

        req = job.request
        prompt = job.prompt
        procs = [GuardedProcessor(p) for p in logits_processors(req, _vocab_size(self.model))]
        if job.grammar is not None:
            procs.append(GuardedProcessor(job.grammar))
        job.guards = procs
        inserted = self.gen.insert_one(
            rest,
            # a prompt scored for no token still runs one step: it ends there
            max_tokens=max(job.max_tokens, 1),
            cache=cache,
            all_tokens=prompt[: job.cached_tokens],
            sampler=self.samplers.get(req, _vocab_size(self.model)),
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

    def _inserted(self, job: Job, key: tuple[int, ...] | None) -> None:
        """``job`` is in mlx-lm's batch: later jobs with its prompt may park on
        it; its first progress event."""
        if key is not None and key not in self.leaders:
            self.leaders[key] = job
            self.leading[job.key] = key
        if job.progress:
            self._progress(job, job.cached_tokens)

    def _start_followers(self, outputs: Outputs) -> None:
        """Insert the jobs parked on the leaders whose prefill just ended, each
        with a copy of its leader's cache (see the module docstring)."""
        prefilled = list(self.gen.prefilled.items())
        self.gen.prefilled.clear()
        for uid, row in prefilled:
            leader = self.by_uid.get(MlxUid(uid))
            if leader is None:
                continue
            followers, leader.followers = leader.followers, []
            for n, job in enumerate(followers):
                job.leader = None
                cache = row if n == len(followers) - 1 else copy.deepcopy(row)
                job.cached_tokens = len(job.prompt) - 1
                try:
                    self._insert(job, job.prompt[-1:], cache, None)
                except Exception as exc:  # noqa: BLE001 - fail this request only (logged in _not_started)
                    self._not_started(job, exc, outputs)
                    continue
                self.stats.shared_prefills += 1
                self._inserted(job, _share_key(job))

    def _prefill_ended(self, job: Job) -> None:
        """``job``'s prefill is over (or it left): no job parks on it any more;
        any still parked go back to admission."""
        key = self.leading.pop(job.key, None)
        if key is not None and self.leaders.get(key) is job:
            del self.leaders[key]
        if job.followers:
            for follower in job.followers:
                follower.leader = None
                self.orphans[follower.key] = follower
            job.followers = []
        if job.uid is not None:
            self.gen.shared.discard(job.uid)

    def _readmit(self, outputs: Outputs) -> None:
        """Admit the parked jobs whose leader left before its prefill ended:
        the first one prefills, the others park on it."""
        while self.orphans:
            key = next(iter(self.orphans))
            self._admit(self.orphans.pop(key), outputs)

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
                self._prefill_ended(prefilling)
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
            self.scored[job.key] = self._prompt_logprobs(job.prompt, job.scores)
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
                events.append(self._logprobs(r.token, r.logprobs, job.request.top_logprobs))
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
        s.parked = sum(len(j.followers) for j in self.leaders.values())
        spec = self.gen.speculation
        if spec is not None:
            s.spec_steps, s.spec_proposed, s.spec_accepted = spec.steps, spec.proposed, spec.accepted
        if self.disk is not None:
            d = self.disk.stats
            s.prefix_cache_disk_bytes, s.prefix_cache_disk_entries = d.bytes, d.entries
            s.prefix_cache_disk_writes, s.prefix_cache_disk_written_bytes = d.writes, d.written_bytes
            s.prefix_cache_disk_read_bytes, s.prefix_cache_disk_evictions = d.read_bytes, d.evictions
            s.prefix_cache_disk_corrupt, s.prefix_cache_disk_dropped_writes = d.corrupt, d.dropped_writes

    def _logprobs(self, token: int, logprobs: mx.array, k: int) -> LogprobsDelta:
        from .sampling import top_logprobs

        tok = self.tokenizer
        lp = float(logprobs[token].item())  # type: ignore[arg-type]  # a float array's item is a float
        text = tok.decode([token])
        tops: tuple[TopLogprob, ...] = ()
        if k:
            ids, vals = top_logprobs(logprobs, k)
            tops = tuple(
                TopLogprob(t, v, tuple(t.encode("utf-8")))
                for t, v in ((tok.decode([i]), v) for i, v in zip(ids, vals, strict=True))
            )
        return LogprobsDelta((TokenLogprob(text, lp, tuple(text.encode("utf-8")), tops),))

    def _prompt_logprobs(self, prompt: list[int], scores: PromptScores) -> PromptLogprobs:
        """The record of a scored prompt: each token's text and the alternatives'."""
        ids = sorted({*prompt, *(i for row in scores.top_ids for i in row)})
        texts = dict(zip(ids, self.tokenizer.batch_decode([[i] for i in ids]), strict=True))

        def top(row_ids: list[int], row_vals: list[float]) -> tuple[TopLogprob, ...]:
            return tuple(TopLogprob(texts[i], v, tuple(texts[i].encode("utf-8")))
                         for i, v in zip(row_ids, row_vals, strict=True))

        positions = len(prompt) - 1
        tops = [top(i, v) for i, v in zip(scores.top_ids, scores.top_logprobs, strict=True)] \
            if scores.top_ids else [()] * positions
        if len(scores.logprobs) != positions or len(tops) != positions:
            raise RuntimeError(f"scored {len(scores.logprobs)} of the prompt's {positions} positions")
        return PromptLogprobs(
            ids=tuple(prompt),
            tokens=tuple(texts[i] for i in prompt),
            logprobs=(None, *scores.logprobs),
            top_logprobs=((), *tops),
        )

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
            per_token = _kv_bytes_per_token(self.model, self.kv_bits, self.kv_group_size, half=bool(self.kv_half))
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
                kv_bits=self.kv_bits,
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
        leader = job.leader
        if leader is not None:  # parked: it leaves its leader
            leader.followers.remove(job)
            job.leader = None
            if not leader.followers and leader.uid is not None:
                self.gen.shared.discard(leader.uid)
        self.orphans.pop(job.key, None)
        self.loading.pop(job.key, None)
        self._prefill_ended(job)  # a leader leaving hands its parked jobs back to admission
        self.by_key.pop(job.key, None)

    def _save_cache(self, tokens: list[int], cache: list[Any], adapter: int = 0,
                    pins: tuple[tuple[int, float], ...] = ()) -> None:
        """Keep a row's cache in the prefix cache's tiers; ``pins``: ``(tokens, ttl)``
        prefixes of ``tokens`` to pin in the memory tier (cache breakpoints)."""
        # mlx-lm extracts a finished row's cache lazily, as a copy of a slice of
        # the whole batch's buffer: evaluate it, or every entry keeps that buffer
        # alive and the byte budget (which counts the slice) means nothing.
        # Asynchronously: waiting here would also wait for the step already
        # queued on the stream, and the next step could not be built meanwhile.
        self.mx.async_eval([c.state for c in cache])
        if self.prefix_cache_bytes > 0:
            key = self._cache_key(adapter)
            for n, ttl in pins:  # before the insertion's eviction, which then spares them
                if 0 < n <= len(tokens):
                    self.prefix_cache.pin(key, list(tokens[:n]), ttl)
            self.prefix_cache.insert_cache(key, list(tokens), cache)
            self._trim_memory()
        if self.disk is not None:
            # written by the disk tier's I/O thread once that evaluation is done
            from mlx_lm.models.cache import can_trim_prompt_cache

            for n, ttl in pins:
                if 0 < n <= len(tokens):
                    self.disk.pin(list(tokens[:n]), ttl, adapter)
            self.disk.save(list(tokens), cache, can_trim_prompt_cache(cache), adapter)

    def _trim_memory(self) -> None:
        """Evict from the memory tier down to its budget (the running batch's caches count)."""
        active = self.gen.prompt_cache_nbytes
        self.prefix_cache.trim_to(n_bytes=max(self.prefix_cache_bytes - active, 0))
        self.stats.prefix_cache_bytes = self.prefix_cache.nbytes

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
        if self.disk is not None:
            self.disk.close()  # the queued writes are finished first


def _nothing() -> None:
    pass


def _share_key(job: Job) -> tuple[int, ...] | None:
    """What a job that may share its prefill is matched by (its adapter, then
    its prompt), or None: a scored prompt needs its own prefill, a one-token
    prompt has nothing to share."""
    if job.prompt_top_logprobs is not None or len(job.prompt) < 2:
        return None
    return (job.adapter, *job.prompt)


def _param_bytes(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    # mlx annotates list-or-dict; without ``destination`` it is always the list of pairs
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return sum(v.nbytes for _, v in flat)


def _vocab_size(model: nn.Module) -> int:
    args = getattr(model, "args", None)
    return int(getattr(args, "vocab_size", 0) or 1 << 30)


def _context_length(model: nn.Module) -> int:
    """The model's context length from its config (0 if it gives none)."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "n_ctx", "context_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _kv_bytes_per_token(model: nn.Module, kv_bits: int | None = None, group_size: int = 64,
                        half: bool = False) -> int:
    """K and V bytes one token adds to the cache (estimate from the config:
    float32 (float16 with ``half``), or ``kv_bits`` per element plus a
    float32 scale and bias per ``group_size`` elements)."""
    args = getattr(model, "args", None)
    if args is None:
        return 0
    layers = getattr(args, "num_hidden_layers", 0) or len(getattr(model, "layers", []))
    heads = getattr(args, "num_key_value_heads", None) or getattr(args, "num_attention_heads", 0) or 0
    hidden = getattr(args, "hidden_size", 0) or 0
    n_heads = getattr(args, "num_attention_heads", 0) or 1
    head_dim = getattr(args, "head_dim", None) or (hidden // n_heads if hidden else 0)
    per_element = (2.0 if half else 4.0) if kv_bits is None else kv_bits / 8 + 2 * 4 / group_size
    return int(2 * layers * heads * head_dim * per_element)
