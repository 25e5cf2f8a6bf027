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

**Admission** (:mod:`.admission`, the worker's base class): a job enters
the batch with what the prefix cache holds of its prompt, after a disk read,
or from another job's prefill of the same prompt; a job asking for prompt
progress gets its events from there.

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

**The step** (:mod:`.stepping`, the worker's other base class): one step of
the batch, each token through its stream's pipeline, the streams that end.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._mlx.malloc import trim
from .._stream.events import Event, StreamFailure
from .admission import Admission
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
from .kv_memory import PROBE_TEXT, default_prefix_budget, param_bytes
from .prefix_tiers import PrefixTiers
from .shared_prefill import SharedPrefill
from .stats import WorkerStats
from .stepping import Stepping

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .._mlx.disk_cache import DiskMatch, DiskPromptCache
    from .._mlx.lora import AdapterRows
    from .._mlx.prefill import EngineBatchGenerator
    from .._mlx.prefix_cache import PinningPromptCache
    from .._mlx.speculative import Speculation
    from .config import EngineConfig
    from .sampling import SamplerCache
    from .shared_prefill import ShareKey

log = logging.getLogger("afm.engine")


class Worker(Admission, Stepping):
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
        from .._mlx.speculative import (
            DraftModel,
            PromptLookup,
            Proposer,
            Speculation,
            untrimmable_layers,
        )

        if self.config.spec_max_batch <= 0:
            return None
        proposer: Proposer
        if self.draft is not None and self.config.draft_tokens > 0:
            proposer, k = DraftModel(self.draft), self.config.draft_tokens
        elif (k := self._lookup_tokens()) > 0:
            proposer = PromptLookup()
        else:
            return None
        asked = self.draft is not None or self.config.prompt_lookup is not None  # (else on by default)
        if layers := untrimmable_layers(self.model):
            log.log(logging.WARNING if asked else logging.INFO,
                    "speculative decoding off: this model's %s layers (sliding windows, recurrent state) "
                    "cannot be trimmed back after a verify step", " and ".join(layers))
            return None
        # asked for, seeded rows speculate too; on by default, they keep their tokens
        return Speculation(proposer, tokens=k, max_batch=self.config.spec_max_batch, seeded=asked)

    def _lookup_tokens(self) -> int:
        """``prompt_lookup``, or when it is None (automatic) the model's default
        (``speculative.auto_lookup_tokens``: on for models bound by reading
        their weights, its tokens by the kernel set), logged."""
        from .._mlx.qmatmul import kernel_isa
        from .._mlx.speculative import auto_lookup_tokens, weight_bytes

        if self.config.prompt_lookup is not None:
            return self.config.prompt_lookup
        if self.config.distributed is not None:
            return 0
        k = auto_lookup_tokens(self.model)
        log.info("prompt lookup: %s (automatic: %d MiB of weights, %s kernels)",
                 f"{k} tokens per step" if k else "off", weight_bytes(self.model) >> 20, kernel_isa() or "no")
        return k

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
            if busy and not self.by_key and not self.embeddings:
                self.mx.clear_cache()  # idle now: MLX's freed buffers go back to the system,
                trim()  # and the free pages of glibc's heaps (afm_core._mlx.malloc)
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


