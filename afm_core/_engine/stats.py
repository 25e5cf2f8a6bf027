"""The generation thread's counters (read by :meth:`Engine.statistics <.engine.Engine.statistics>`)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """Jobs started from another job's prefill of the same prompt (see :mod:`.shared_prefill`)."""
    parked: int = 0
    """Jobs waiting now for another job's prefill of the same prompt."""
    spec_steps: int = 0
    """Verify steps of speculative decoding (see :mod:`afm_core._mlx.speculative`)."""
    spec_proposed: int = 0
    """Tokens proposed to them (prompt lookup or the draft model)."""
    spec_accepted: int = 0
    """Of those, tokens the model agreed with (emitted without a step of their own)."""
    finished: dict[str, int] = field(default_factory=dict)
