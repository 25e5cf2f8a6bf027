"""The engine's settings (:class:`EngineConfig`), in a module of their own so
that request preparation and the engine read them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["WARMUP_WIDTH", "DistributedConfig", "EngineConfig"]

WARMUP_WIDTH = 4
"""Widest decode batch the start-up warm-up runs (see ``EngineConfig.warmup``)."""


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    """One model sharded over the ranks of an ``mx.distributed`` group (see
    ``afm_core._engine.distributed`` and ``docs/distributed.md``).  Rank 0
    runs the engine with this setting (``EngineConfig.distributed``); every
    other rank runs :func:`~afm_core.run_follower` with the same one."""

    mode: str = "tensor"
    """``tensor`` (each layer split over the ranks: ``model.shard``) or
    ``pipeline`` (consecutive layers per rank: ``model.model.pipeline``)."""
    backend: str = "any"
    """MLX's distributed back-end (``ring``: TCP between hosts, ``mpi``,
    ``jaccl``, ...); ``any`` takes the one the launcher set up."""
    timeout: float = 60.0
    """Seconds a rank may wait inside one collective operation (an engine
    step, a broadcast of the step's commands, an embedding) before the group
    counts as broken: on rank 0 every open stream then ends with a
    ``distributed_failed`` error and the engine reports unhealthy (``/health``
    503); a follower exits.  A peer that *dies* is usually seen at once (its
    connection closes); this bounds the wait for one that hangs or whose host
    is unreachable.  Must exceed the longest step (a prefill chunk of
    ``prefill_step`` tokens)."""
    heartbeat: float = 1.0
    """Seconds between the idle rank 0's empty broadcasts, so a lost follower
    is noticed (and ``/health`` turns 503) without waiting for a request, and
    followers notice a lost rank 0."""
    exit_after: float | None = None
    """Once the group is broken, end the process (status 1) after this many
    seconds (time for ``/health`` to report it and open streams to get their
    error), so a supervisor restarts every rank; None keeps it running,
    unhealthy.  The generation thread of a rank stuck in a collective never
    returns, so shutting such an engine down can only end this way."""

    def __post_init__(self) -> None:
        if self.mode not in ("tensor", "pipeline"):
            raise ValueError("distributed mode must be 'tensor' or 'pipeline'")
        if not self.timeout > 0 or not self.heartbeat > 0:
            raise ValueError("distributed timeout and heartbeat must be > 0")
        if self.exit_after is not None and self.exit_after < 0:
            raise ValueError("distributed exit_after must be >= 0 or None")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine settings; every field can be passed to :func:`open_engine`
    (``open_engine(path, max_batch=8)``) or given as one record (``config=``).
    Sizes are counts unless the name says otherwise."""

    max_batch: int = 32
    """Streams decoded together, one token each per engine step (mlx-lm's
    ``completion_batch_size``); at least 1.  Further requests wait (see
    ``max_waiting``).  Wider batches give more tokens per second in total but
    make every step, so each stream's tokens, slower, and hold one KV cache
    per stream in memory."""
    max_waiting: int = 64
    """Requests accepted beyond ``max_batch`` (being templated, or waiting for
    a place in the batch) before a new one is refused with
    :class:`EngineBusyError` (HTTP 503 with ``Retry-After``); 0 refuses as soon
    as ``max_batch`` requests are in flight.  A longer queue turns overload
    into waiting (time to first token grows) instead of refusals a client or
    load balancer could send elsewhere."""
    prefill_batch: int = 8
    """Prompts prefilled together as one group (mlx-lm's
    ``prefill_batch_size``, capped at ``max_batch``); at least 1.  A larger
    group starts more waiting requests at once (a burst reaches its first
    tokens sooner) but makes the steps that prefill it longer, pausing the
    streams already decoding for that time."""
    prefill_step: int = 2048
    """Prompt tokens per row prefilled in one engine step (mlx-lm's
    ``prefill_step_size``); at least 1.  A longer prompt is prefilled over
    several steps, and the running streams decode one token between them.
    Smaller chunks keep their tokens flowing while a long prompt arrives, at
    the cost of more steps (and a slower first token) for that prompt."""
    prefill_step_decoding: int = 256
    """While other streams are decoding, prompt tokens prefilled per step,
    counted at what tokens cost at the start of a prompt: a chunk later in a
    long prompt (whose attention reads more keys) holds fewer tokens, so every
    chunk takes about as long, shared among the prompts prefilled together
    (times prompts per decoding stream when the prompts are more: a burst
    behind one stream starts in one step, each prompt with the chunk a lone
    prompt would get).
    The running streams get a token between every two chunks, so this bounds
    how long a long prompt arriving stalls them (a running stream's longest
    gap between tokens), at the cost of more steps for that prompt's prefill
    (its first token comes later).  With no stream decoding, a prompt is
    prefilled ``prefill_step`` tokens at a time.  0: always ``prefill_step``
    (mlx-lm's behaviour)."""
    prefix_cache_bytes: int | None = None
    """Bytes of KV cache kept from finished (or cancelled) requests so a
    later prompt that starts the same way (the next turn of a chat, a shared
    system prompt, a retry) prefills only what is new (``cached_tokens`` in
    its usage).  None (the default) sizes it to the model: the KV cache of
    one request filling the model's whole context, at most 1 GiB (the
    default model: 188 MiB with a float16 cache), so the longest
    conversation the model can hold stays cached, or many shorter ones.  The
    running batch's own caches count against the budget, and the least
    recently used entries go first (at most 256 are kept); 0 disables the
    cache (no lookups, nothing kept).  Memory traded for prefill time."""
    cache_dir: str | Path | None = None
    """A directory for the prefix cache's disk tier (created if missing);
    None (the default) keeps the cache in memory only.  Every finished
    request's cache is also written there (in the background, one
    checksummed file per entry, mlx-lm's prompt-cache format), so a prompt
    the memory tier no longer holds (evicted, or the server restarted) is
    read back instead of prefilled, and moves into memory again.  Entries of
    another model (or of this model's files changed since) are ignored; a
    corrupt or truncated file is deleted, never served.  One directory per
    server process.  With ``prefix_cache_bytes`` 0 the disk is the only
    tier.  Not with ``distributed``."""
    cache_disk_bytes: int = 8 << 30
    """Bytes the disk tier may use (8 GiB by default); beyond, the least
    recently used entries (written or read) are deleted."""
    default_max_tokens: int | None = None
    """Tokens a request may generate when it gives no ``max_tokens``;
    ``None`` (the default) allows the rest of the context (the model's
    context length minus the prompt), and a value is still capped by it.  A
    lower cap stops a stream that never ends on its own from holding a batch
    place until the context is full."""
    keep_volatile_lines: bool = False
    """Keep the volatile lines clients put into system text (Claude Code's
    per-prompt ``x-anthropic-billing-header:`` line; the rule list is
    :data:`afm_core.api.volatile.VOLATILE_LINES`).  False (the default)
    takes them out before the chat template renders the prompt, so sessions
    that differ only there share their prefix in the prefix cache."""
    grammar: bool = True
    """Enforce what a request makes strict (a ``json_schema`` with
    ``strict: true``, ``tool_choice`` ``required`` or a named function, strict
    tools under ``auto``) with llguidance token masks.  False generates such
    requests unconstrained, best-effort, and marks them downgraded
    (``ChatStream.grammar_downgraded``, the ``X-Grammar-Constraints`` header).
    The mask of each constrained stream is computed on the generation thread
    at every step it decodes."""
    enforce_json_modes: bool = True
    """Enforce the non-strict JSON modes with the grammar too: ``response_format``
    ``json_object`` (any JSON object) and a ``json_schema`` without ``strict:
    true`` (its schema), best-effort: a schema llguidance cannot compile is
    generated unconstrained (the content still sanitized) and marked downgraded
    (``X-Grammar-Constraints``), where a strict one is a 400.  False keeps
    those modes sanitize-only (unconstrained, not marked).  Needs ``grammar``."""
    template_threads: int = 2
    """Worker threads that render chat templates and tokenize prompts at the
    same time (a Trio ``CapacityLimiter``).  More let a burst of requests be
    prepared in parallel; each competes with the generation thread for the
    CPU and the GIL."""
    embedding_step: int = 512
    """Tokens of embedding work (:meth:`Engine.embed`) the generation thread
    computes after each decode step, at most: running streams wait that long
    between two tokens while embeddings are computed (a long input runs in
    slices through a KV cache; short ones together).  Smaller keeps streams
    smoother, larger embeds faster when nothing else runs."""
    prepare_timeout: float = 60.0
    """Seconds one request's preparation (templating, tokenizing, compiling its
    grammar) may take once it started; past them it stops and the request gets
    503 ``prepare_timeout`` (:mod:`afm_core._engine.lanes`).  Work beyond 64 Ki
    characters runs in a lane of its own (one thread), so small requests never
    wait behind it; work whose caller left stops at its next piece."""
    profile_sample_interval: float = 0.1
    """Seconds between the samples (tokens, decode rate, batch width, active
    memory) of an ``extended`` profile (``profile="extended"``, the
    ``X-AFM-Profile`` header); samples are taken at engine steps, at most one
    per interval.  Shorter intervals give a finer timeline and a larger
    payload; no effect on requests without an extended profile."""
    warmup: bool = True
    """Before the engine reports started, run a few short requests through
    the whole path (template, prefill, decode at batch widths 1 to
    ``WARMUP_WIDTH``), so the first real request pays no one-time cost
    (MLX's CPU kernel compilation, OpenBLAS's thread start, the template's
    first render); counters and the prefix cache are reset afterwards.
    Start-up takes that much longer (a model that cannot chat skips it with a
    warning); False starts at once and leaves the cost to the first requests."""
    cpu_fusion: bool = True
    """On MLX's CPU backend, run the model's norms and rotary embeddings as
    fused kernels and, under the reference BLAS, its linear layers with
    transposed weights (see ``afm_core._mlx.fusion``); no effect on the GPU.
    Faster decode steps for results equal to mlx's layers up to float
    rounding, and a compiled trace per batch width; False runs mlx-lm's
    layers unchanged."""
    embedding_pooling: str = "mean"
    """How :meth:`Engine.embed` (``POST /v1/embeddings``) pools the model's
    final hidden states (after the final norm, before the LM head) into one
    vector per input, L2-normalized, as llama.cpp's server does: ``mean``
    (the average over the input's tokens), ``last`` (the last token's state:
    the pooling of decoder-only embedding models such as Qwen3-Embedding) or
    ``cls`` (the first token's).  Which one fits depends on how the model
    was trained; a chat model gives usable but not tuned embeddings with any."""
    kv_bits: int | None = None
    """Quantize the KV cache to this many bits per element (8 or 4; mlx-lm's
    ``QuantizedKVCache`` format, batched by ``afm_core._mlx.quantized_cache``)
    from every sequence's first token; None (the default) keeps it in the
    model's float type.  8 bits hold a token's keys and values in 28% of
    float32's bytes (53% of bfloat16's), 4 bits in 16% (31%), so more and longer
    streams (and more prefix-cache entries) fit the same memory; attention
    then reads quantized keys and values (a small change in the logits: the
    greedy output may differ from float's after some tokens, more often with
    4 bits); on the CPU its decode attention is one operation per layer
    (``ext/qmm/quantized_attention.cpp``), about as fast as float's.  Entries of the
    prefix cache's disk tier are only served to an engine with the same
    setting.  A model with other than plain KV layers (sliding windows,
    recurrent state) cannot be quantized: the engine does not start.  Not
    with ``distributed``."""
    kv_group_size: int = 64
    """Elements sharing one scale and bias in the quantized KV cache (32, 64
    or 128; must divide the model's head size); only with ``kv_bits``."""
    kv_dtype: str = "auto"
    """The float KV cache's element type (without ``kv_bits``): ``float16``
    stores keys and values in half precision, half of float32's bytes (the
    rounding llama.cpp's default cache makes); ``model`` keeps the type the
    model computes in (float32 for afm's CPU conversions); ``auto`` (the
    default) picks float16 where the model computes in float32 and its keys
    and values stay far inside float16's range (a probe pass at start-up:
    at most 4096, 16x below float16's largest), else the model's type.
    Layers with sliding windows keep the model's type.  Entries of the
    prefix cache's disk tier are only served to an engine with the same
    type."""

    adapters: tuple[tuple[str, str], ...] = ()
    """LoRA adapters served beside the model, as ``(name, directory)`` pairs
    (mlx-lm adapter directories, as ``mlx_lm.lora`` writes them); a request
    picks one by name (``ChatRequest.adapter``, or a ``model`` of the form
    ``base:name``) and the others run without.  Requests on different
    adapters decode in the same batch: each targeted layer adds each row's
    own adapter's update (``afm_core._mlx.lora``); a prefix-cache entry
    serves only requests on its own adapter (on disk too: entries are keyed
    by a digest of the adapter's files, so a restart with other weights under
    the same name never reads the old ones).  Names may not hold ``:``.  Not with ``distributed``."""

    prompt_lookup: int | None = None
    """Speculative decoding by prompt lookup: when the last tokens of a
    stream occurred earlier in its prompt or
    output, the tokens that followed them there (at most this many) are
    checked by one forward pass of the model, and those it agrees with are
    emitted at once.  Greedy output is the same tokens; sampled output
    (``temperature``, ``top_p``, ``top_k``, ``min_p``) has the same
    distribution (speculative sampling); grammar, penalties and
    ``logit_bias`` apply at every checked position.  Text that repeats its
    prompt (edits of code or a document, quotes, extraction) comes faster.
    None (the default): automatic, for a model of at least 256 MiB of
    weights 4 tokens with the VNNI kernels and 2 with the others (a verify
    pass reads the weights once for several tokens, so it paid on chat too;
    without VNNI a pass over 5 positions costs about two steps), off for
    smaller ones (where on free text it lost a few percent); see
    :func:`afm_core._mlx.speculative.auto_lookup_tokens`.
    Automatic lookup leaves sampled requests with a ``seed`` out (they keep
    the tokens they get without speculation).
    0 disables it.  See ``spec_max_batch`` and
    :mod:`afm_core._mlx.speculative`."""
    draft_model: str | Path | None = None
    """A smaller model with the same tokenizer (a path or Hugging Face id)
    whose greedy guesses (``draft_tokens`` per step) the model checks, as
    for ``prompt_lookup`` (which it replaces); None (the default): no draft
    model.  Each speculating stream keeps a KV cache in the draft too."""
    draft_tokens: int = 4
    """Tokens the draft model guesses per step (with ``draft_model``); at least 1."""
    spec_max_batch: int = 1
    """Speculate only while at most this many streams are decoding; with more,
    the plain batched step runs (decided again before every step, so a
    stream speculates while it is alone and stops when others join, never
    refused).  0 disables speculation.  A wider batch already amortizes each
    step's overhead across its streams, and its verify passes cost more
    than the tokens they save (see docs/performance.md, "Speculative decoding")."""

    distributed: DistributedConfig | None = None
    """Serve one model sharded over the ranks of an ``mx.distributed`` group
    (:class:`DistributedConfig`): this engine is rank 0, every other rank runs
    :func:`~afm_core.run_follower`.  None: the whole model in this process."""

    def __post_init__(self) -> None:
        if self.embedding_step < 1:
            raise ValueError("embedding_step must be >= 1 token")
        if not self.prepare_timeout > 0:
            raise ValueError("prepare_timeout must be > 0 seconds")
        if self.embedding_pooling not in ("mean", "last", "cls"):
            raise ValueError("embedding_pooling must be 'mean', 'last' or 'cls'")
        if self.max_batch < 1 or self.max_waiting < 0 or self.prefill_batch < 1 or self.prefill_step < 1:
            raise ValueError("max_batch, prefill_batch and prefill_step must be >= 1, max_waiting >= 0")
        if self.prefill_step_decoding < 0:
            raise ValueError("prefill_step_decoding must be >= 0 (0: always prefill_step)")
        if self.kv_bits is not None and self.kv_bits not in (4, 8):
            raise ValueError("kv_bits must be 4, 8 or None (a float KV cache)")
        if self.kv_group_size not in (32, 64, 128):
            raise ValueError("kv_group_size must be 32, 64 or 128")
        if self.kv_dtype not in ("auto", "float16", "model"):
            raise ValueError("kv_dtype must be 'auto', 'float16' or 'model'")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError("prefix_cache_bytes must be >= 0 (or None: sized to the model)")
        if self.kv_bits is not None and self.distributed is not None:
            # the sharded generator and its followers build float caches of their own
            raise ValueError("kv_bits (a quantized KV cache) cannot be used with distributed")
        if (self.prompt_lookup is not None and self.prompt_lookup < 0) or self.draft_tokens < 1 \
                or self.spec_max_batch < 0:
            raise ValueError("prompt_lookup (or None: automatic) and spec_max_batch must be >= 0, "
                             "draft_tokens >= 1")
        if self.distributed is not None and self.spec_max_batch and (self.prompt_lookup or self.draft_model):
            raise ValueError("speculative decoding (prompt_lookup, draft_model) cannot be used with distributed")
        if self.cache_disk_bytes < 0:
            raise ValueError("cache_disk_bytes must be >= 0")
        names = [name for name, _ in self.adapters]
        if any(not name or ":" in name for name in names) or len(set(names)) != len(names):
            raise ValueError("adapter names must be unique, non-empty and hold no ':'")
        if self.adapters and self.distributed is not None:
            raise ValueError("adapters cannot be used with distributed")
        if self.cache_dir is not None and self.distributed is not None:
            # every rank holds its own shard of each cache: rank 0's files would
            # serve its shard only, and the followers replay the memory tier alone
            raise ValueError("cache_dir (the prefix cache's disk tier) cannot be used with distributed: "
                             "each rank holds only its shard of every cache")
