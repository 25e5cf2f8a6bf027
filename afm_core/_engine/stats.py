"""The engine's statistics: the record the engine hands out and the counters
the generation thread keeps.

:class:`EngineStatistics` is the one declaration of every statistic: its
fields' metadata (:func:`counter`, :func:`gauge`) name each one's Prometheus
family and help text for ``/metrics`` and mark what ``/health`` reports, so
the HTTP server lists nothing itself.  :class:`WorkerStats` holds the
counters the generation thread updates; ``Engine.statistics`` copies those
whose names :class:`EngineStatistics` shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class Metric:
    """How ``/metrics`` exports one statistic (Prometheus text format)."""

    name: str
    kind: str
    """``counter`` or ``gauge``."""
    help: str


def counter(name: str, help: str, *, health: bool = False) -> dict[str, Any]:
    """A field's metadata: exported as the Prometheus counter ``name``."""
    return {"metric": Metric(name, "counter", help), "health": health}


def gauge(name: str, help: str, *, health: bool = False) -> dict[str, Any]:
    """A field's metadata: exported as the Prometheus gauge ``name``; with
    ``health``, ``/health`` reports it too (summed over the served models)."""
    return {"metric": Metric(name, "gauge", help), "health": health}


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of the engine (see :meth:`Engine.statistics <.engine.Engine.statistics>`).

    Each field's metadata says how the HTTP server shows it: its Prometheus
    family on ``/metrics`` (:meth:`metrics`), and whether ``/health`` sums it
    over the served models (:meth:`health_fields`)."""

    running: int = field(metadata=gauge("afm_requests_running", "Streams in the decode batch.", health=True))
    waiting: int = field(metadata=gauge("afm_requests_waiting", "Admitted requests not yet decoding.", health=True))
    requests_total: int = field(metadata=counter("afm_requests_total", "Requests submitted to the engine."))
    requests_active: int = field(metadata=gauge(
        "afm_requests_active",
        "Requests registered with the engine.", health=True))
    prompt_tokens: int = field(metadata=counter("afm_prompt_tokens_total", "Prompt tokens submitted."))
    cached_tokens: int = field(metadata=counter(
        "afm_cached_prompt_tokens_total",
        "Prompt tokens served from the prefix cache."))
    generation_tokens: int = field(metadata=counter("afm_generation_tokens_total", "Tokens generated."))
    prefix_cache_hits: int = field(metadata=counter(
        "afm_prefix_cache_hits_total",
        "Requests that reused a cached prefix."))
    prefix_cache_lookups: int = field(metadata=counter("afm_prefix_cache_lookups_total", "Prefix cache lookups."))
    prefix_cache_bytes: int = field(metadata=gauge("afm_prefix_cache_bytes", "Bytes held by the prefix cache."))
    steps: int = field(metadata=counter("afm_engine_steps_total", "Engine steps run."))
    ttft_seconds_sum: float
    ttft_count: int
    finished: dict[str, int] = field(default_factory=dict)
    blas: str = ""
    """The BLAS computing MLX's CPU products (``openblas``, ``reference``,
    ``accelerate``; see ``afm_core._mlx.blas``), once the engine has started."""
    shared_prefills: int = field(default=0, metadata=counter(
        "afm_shared_prefills_total",
        "Requests started from another request's prefill of the same prompt."))
    """Requests started from another request's prefill of the same prompt
    (several choices of one prompt, identical requests arriving together):
    each computed one prompt token instead of all of them."""
    kept_prefixes: int = 0
    """Requests that left before they ended (cancelled, or their client went
    away) whose computed prefix (a prefill stopped part-way, or the prompt
    and the output so far) was kept in the prefix cache for a retry."""
    embedding_requests: int = field(default=0, metadata=counter(
        "afm_embedding_requests_total",
        "Embedding calls answered."))
    """:meth:`Engine.embed` calls answered."""
    embedding_tokens: int = field(default=0, metadata=counter(
        "afm_embedding_tokens_total",
        "Input tokens of the embedding calls."))
    """Their input tokens."""
    embeddings_active: int = field(default=0, metadata=gauge("afm_embeddings_active", "Embedding calls running."))
    """:meth:`Engine.embed` calls running now (they count toward ``max_waiting``)."""
    prefix_cache_memory_hits: int = field(default=0, metadata=counter(
        "afm_prefix_cache_memory_hits_total",
        "Prefix cache lookups the memory tier served."))
    """Lookups the memory tier of the prefix cache served (``prefix_cache_hits``
    counts both tiers' hits)."""
    prefix_cache_memory_misses: int = field(default=0, metadata=counter(
        "afm_prefix_cache_memory_misses_total",
        "Prefix cache lookups the memory tier did not serve."))
    """Lookups the memory tier did not serve (the disk tier may have)."""
    prefix_cache_disk_hits: int = field(default=0, metadata=counter(
        "afm_prefix_cache_disk_hits_total",
        "Prefix cache lookups the disk tier (--cache-dir) served."))
    """Lookups the disk tier (``EngineConfig.cache_dir``) served: its entry was
    read back instead of prefilling the prompt's prefix."""
    prefix_cache_disk_misses: int = field(default=0, metadata=counter(
        "afm_prefix_cache_disk_misses_total",
        "Prefix cache lookups neither tier served, with a disk tier."))
    """Lookups neither tier served, with a disk tier."""
    prefix_cache_disk_bytes: int = field(default=0, metadata=gauge(
        "afm_prefix_cache_disk_bytes",
        "Bytes of the prefix cache's disk tier files."))
    """Bytes of the disk tier's files (this model's)."""
    prefix_cache_disk_entries: int = field(default=0, metadata=gauge(
        "afm_prefix_cache_disk_entries",
        "Entries in the prefix cache's disk tier."))
    """Entries in the disk tier."""
    prefix_cache_disk_writes: int = field(default=0, metadata=counter(
        "afm_prefix_cache_disk_writes_total",
        "Entries written to the disk tier."))
    """Entries written to the disk tier."""
    prefix_cache_disk_written_bytes: int = field(default=0, metadata=counter(
        "afm_prefix_cache_disk_written_bytes_total",
        "Bytes written to the disk tier."))
    """Their bytes."""
    prefix_cache_disk_read_bytes: int = field(default=0, metadata=counter(
        "afm_prefix_cache_disk_read_bytes_total",
        "Bytes read back from the disk tier."))
    """Bytes read back from the disk tier."""
    prefix_cache_disk_evictions: int = field(default=0, metadata=counter(
        "afm_prefix_cache_disk_evictions_total",
        "Disk tier entries deleted to stay within --cache-disk-bytes."))
    """Entries deleted to keep the disk tier within ``cache_disk_bytes``."""
    prefix_cache_disk_corrupt: int = field(default=0, metadata=counter(
        "afm_prefix_cache_disk_corrupt_total",
        "Disk tier files found corrupt or truncated (deleted, never served)."))
    """Disk entries found corrupt or truncated (deleted, never served)."""
    prefix_cache_disk_dropped_writes: int = field(default=0, metadata=counter(
        "afm_prefix_cache_disk_dropped_writes_total",
        "Disk tier writes given up (superseded, backlog, or failed)."))
    """Writes given up (superseded by a longer entry before they began, more
    pending than the disk keeps up with, or failed)."""
    kv_bits: int | None = None
    """Bits per element of the KV cache (``EngineConfig.kv_bits``: 8 or 4,
    quantized); None: float."""
    kv_group_size: int | None = None
    """Elements per scale of the quantized KV cache; None with a float one."""
    kv_cache: str = ""
    """The KV cache's element type as chosen at start (``EngineConfig.kv_dtype``):
    ``float16``, ``the model's type`` or e.g. ``8-bit (groups of 64)``."""
    prefix_cache_budget: int = 0
    """Bytes the prefix cache's memory tier may hold (``EngineConfig.prefix_cache_bytes``,
    or the size chosen for the model)."""
    spec_steps: int = field(default=0, metadata=counter(
        "afm_spec_steps_total",
        "Speculative decoding verify steps (--prompt-lookup, --draft-model)."))
    """Verify steps of speculative decoding (``EngineConfig.prompt_lookup``,
    ``draft_model``): steps that checked proposed tokens."""
    spec_proposed: int = field(default=0, metadata=counter(
        "afm_spec_proposed_tokens_total",
        "Tokens proposed to speculative verify steps."))
    """Tokens proposed in them."""
    spec_accepted: int = field(default=0, metadata=counter(
        "afm_spec_accepted_tokens_total",
        "Proposed tokens the model accepted (acceptance rate: accepted / proposed)."))
    """Proposed tokens the model agreed with, each emitted without a step of
    its own (acceptance rate: ``spec_accepted / spec_proposed``)."""
    preparations_abandoned: int = field(default=0, metadata=counter(
        "afm_preparations_abandoned_total",
        "Preparations (templating, tokenizing) stopped because their caller left."))
    """Preparations (templating, tokenizing; ``tokenize`` and ``embed`` texts)
    stopped before their end because their caller left (a client that hung
    up): their thread went back to its lane at once."""

    @classmethod
    def metrics(cls) -> tuple[tuple[str, Metric], ...]:
        """``(field, metric)`` of every field exported to ``/metrics``, in field order."""
        return tuple((f.name, f.metadata["metric"]) for f in fields(cls) if "metric" in f.metadata)

    @classmethod
    def health_fields(cls) -> tuple[str, ...]:
        """The fields ``/health`` reports, summed over the served models."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("health"))


@dataclass
class WorkerStats:
    """Counters the generation thread updates and the engine reads (ints:
    atomic enough).  A field named as one of :class:`EngineStatistics`'s is
    that statistic (documented there; :data:`WORKER_COUNTERS`); the others are
    the thread's own."""

    running: int = 0
    prefilling: int = 0
    """Rows prefilling their prompt now."""
    queued: int = 0
    """Rows inserted into the batch, waiting for their prefill."""
    steps: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    """Prompt tokens prefilled (not served by the prefix cache or a shared prefill)."""
    cached_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_lookups: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_memory_hits: int = 0
    prefix_cache_disk_hits: int = 0
    prefix_cache_disk_misses: int = 0
    prefix_cache_disk_bytes: int = 0
    prefix_cache_disk_entries: int = 0
    prefix_cache_disk_writes: int = 0
    prefix_cache_disk_written_bytes: int = 0
    prefix_cache_disk_read_bytes: int = 0
    prefix_cache_disk_evictions: int = 0
    prefix_cache_disk_corrupt: int = 0
    prefix_cache_disk_dropped_writes: int = 0
    kept_prefixes: int = 0
    shared_prefills: int = 0
    parked: int = 0
    """Jobs waiting now for another job's prefill of the same prompt (see :mod:`.shared_prefill`)."""
    spec_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    finished: dict[str, int] = field(default_factory=dict)


WORKER_COUNTERS = tuple(
    f.name for f in fields(EngineStatistics)
    if f.name != "finished" and f.name in {g.name for g in fields(WorkerStats)})
"""The statistics the generation thread counts (:class:`WorkerStats`), copied by name."""
