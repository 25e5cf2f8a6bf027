"""The prefix cache's two tiers, as the generation thread uses them.

Finished requests' caches go to the memory tier (mlx-lm's ``LRUPromptCache``,
:class:`~afm_core._mlx.prefix_cache.PinningPromptCache`) and, with
``cache_dir``, to the disk tier too
(:class:`~afm_core._mlx.disk_cache.DiskPromptCache`, written in the
background: write-through, so what a killed process had served is on disk but
for the writes under way).  Admission asks both how much of the prompt they
hold; the memory tier serves unless the disk tier holds enough more
(:data:`DISK_GAIN`), in which case the job waits, out of the batch, for its
entry to be read (by the disk tier's I/O thread, while the batch keeps
decoding; ``loading``); the entry then moves into the memory tier and the job
is inserted with its copy (:meth:`PrefixTiers.poll_disk`).  A file that turns
out corrupt is deleted and the job falls back to the memory tier's answer.

What a row computed under one LoRA adapter never serves another: the memory
tier's entries are keyed by adapter (:meth:`PrefixTiers.key`), and the disk
tier keys its entries by the adapter's content.

:class:`PrefixTiers` runs on the generation thread only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .commands import Job, JobKey

if TYPE_CHECKING:
    from .._mlx.disk_cache import DiskMatch, DiskPromptCache
    from .._mlx.prefix_cache import PinningPromptCache

DISK_GAIN = 4
"""The disk tier serves a prompt when the tokens it holds beyond the memory
tier's answer, times this, reach its entry's length: reading an entry costs
about its length (reading KV is many times faster than computing it), so a
small gain from a long entry (a chat template's first tokens, shared with a
long conversation) is not worth reading it."""


@dataclass
class TierCounts:
    """The tiers' lookup counters (the worker copies them into its statistics)."""

    lookups: int = 0
    hits: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    """Lookups served by the disk tier (each also a hit and a memory miss)."""
    disk_misses: int = 0
    """Lookups neither tier served, with a disk tier."""
    memory_bytes: int = 0
    """The memory tier's bytes after its last trim."""


class PrefixTiers:
    """The memory tier (``memory``, set by the worker once the model's budget
    is known), the optional disk tier (``disk``, :meth:`open_disk`) and the
    jobs waiting for a disk read (``loading``).

    ``budget``: the memory tier's bytes (0: no memory tier); ``active``: the
    bytes the running batch's caches hold now, which count against it.
    """

    memory: PinningPromptCache

    def __init__(self, model_key: str, budget: int, *, active: Callable[[], int]):
        self.model_key = model_key
        self.budget = budget
        self._active = active
        self.disk: DiskPromptCache | None = None
        self.loading: dict[JobKey, tuple[Job, DiskMatch]] = {}
        self.counts = TierCounts()

    def open_disk(self, cache_dir: Any, max_bytes: int, fingerprint: str, *, wake: Callable[[], None],
                  adapters: tuple[str, ...] = ()) -> None:
        """Open the disk tier (once: it outlives a generator made again)."""
        from .._mlx.disk_cache import DiskPromptCache

        if self.disk is None:
            self.disk = DiskPromptCache(cache_dir, max_bytes, fingerprint, wake=wake, adapters=adapters)

    @property
    def caching(self) -> bool:
        """Whether finished requests' caches are kept (in either tier)."""
        return self.budget > 0 or self.disk is not None

    def key(self, adapter: int) -> str:
        """The memory tier's model key for rows on ``adapter`` (a cache computed
        under one adapter never serves another)."""
        return self.model_key if not adapter else f"{self.model_key}\0adapter:{adapter}"

    # -- lookups -------------------------------------------------------------

    def fetch_memory(self, prompt: list[int], adapter: int = 0) -> tuple[list[Any] | None, list[int]]:
        """The memory tier's cache for ``prompt`` on ``adapter`` (a copy) and
        the tokens it leaves to compute (at least the last one)."""
        from mlx_lm.models.cache import trim_prompt_cache

        if self.budget <= 0:
            return None, prompt
        cache, rest = self.memory.fetch_nearest_cache(self.key(adapter), prompt)
        if cache is None:
            return None, prompt
        if not rest:
            # exact hit: recompute the last token so generation has an input
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        return cache, rest

    def count(self, job: Job, tier: str) -> None:
        """Count ``job``'s lookup as served by ``tier`` if it got cached tokens, else
        as a miss; a hit refreshes the pins on the prefix it read."""
        c = self.counts
        if not job.cached_tokens:
            if self.disk is not None:
                c.disk_misses += 1
            return
        c.hits += 1
        read = job.prompt[:job.cached_tokens]  # the pins on what it read hold for their ttl again
        if self.budget > 0:
            self.memory.refresh(self.key(job.adapter), read)
        if self.disk is not None:
            self.disk.refresh(read, job.adapter)
        if tier == "disk":
            c.disk_hits += 1
        else:
            c.memory_hits += 1
        if job.profile is not None:
            job.profile.prefix_tier = tier

    def read_disk(self, job: Job) -> bool:
        """Start reading the disk tier's entry for ``job`` if it holds enough
        more of the prompt than the memory tier (see :data:`DISK_GAIN`); True
        if the job now waits for it (in ``loading``, until :meth:`poll_disk`)."""
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
        if self.budget > 0:
            in_memory = min(memory_served(self.memory, self.key(job.adapter), prompt), len(prompt) - 1)
        gain = served - in_memory
        if gain <= 0 or gain * DISK_GAIN < len(match.entry.tokens):
            return False
        disk.load(match.entry)
        self.loading[job.key] = (job, match)
        return True

    def poll_disk(self) -> Iterator[tuple[Job, DiskMatch, list[Any] | None]]:
        """The disk tier's finished reads: each entry read moves into the
        memory tier; yields the jobs that waited for it, each with its own copy
        of it (None: the file failed, the memory tier serves), one entry's jobs
        before the next entry is promoted."""
        if self.disk is None:
            return
        for loaded in self.disk.poll():
            waiting = [(job, match) for job, match in self.loading.values() if match.entry is loaded.entry]
            for job, _ in waiting:
                del self.loading[job.key]
            cache = loaded.cache
            promoted = cache is not None and self.budget > 0
            if promoted:
                assert cache is not None
                self.memory.insert_cache(self.key(loaded.entry.adapter), list(loaded.entry.tokens), cache)
                self.trim()
            for n, (job, match) in enumerate(waiting):
                mine = None
                if cache is not None:
                    mine = cache if not promoted and n == len(waiting) - 1 else copy.deepcopy(cache)
                yield job, match, mine

    # -- keeping -------------------------------------------------------------

    def save(self, tokens: list[int], cache: list[Any], adapter: int = 0,
             pins: tuple[tuple[int, float], ...] = ()) -> None:
        """Keep a row's cache in the tiers; ``pins``: ``(tokens, ttl)`` prefixes
        of ``tokens`` to pin (cache breakpoints)."""
        import mlx.core as mx

        # mlx-lm extracts a finished row's cache lazily, as a copy of a slice of
        # the whole batch's buffer: evaluate it, or every entry keeps that buffer
        # alive and the byte budget (which counts the slice) means nothing.
        # Asynchronously: waiting here would also wait for the step already
        # queued on the stream, and the next step could not be built meanwhile.
        mx.async_eval([c.state for c in cache])
        if self.budget > 0:
            key = self.key(adapter)
            for n, ttl in pins:  # before the insertion's eviction, which then spares them
                if 0 < n <= len(tokens):
                    self.memory.pin(key, list(tokens[:n]), ttl)
            self.memory.insert_cache(key, list(tokens), cache)
            self.trim()
        if self.disk is not None:
            # written by the disk tier's I/O thread once that evaluation is done
            from mlx_lm.models.cache import can_trim_prompt_cache

            for n, ttl in pins:
                if 0 < n <= len(tokens):
                    self.disk.pin(list(tokens[:n]), ttl, adapter)
            self.disk.save(list(tokens), cache, can_trim_prompt_cache(cache), adapter)

    def trim(self) -> None:
        """Evict from the memory tier down to its budget (the running batch's caches count)."""
        self.memory.trim_to(n_bytes=max(self.budget - self._active(), 0))
        self.counts.memory_bytes = self.memory.nbytes

    # -- the worker's life ---------------------------------------------------

    def reset(self, memory: PinningPromptCache) -> None:
        """Zero the counters, start again from ``memory`` (empty), empty the disk tier."""
        self.counts = TierCounts()
        self.memory = memory
        if self.disk is not None:
            self.disk.reset()

    def close(self) -> None:
        """Close the disk tier (its queued writes are finished first)."""
        if self.disk is not None:
            self.disk.close()
