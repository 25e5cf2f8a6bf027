"""Everything that reaches into MLX or mlx-lm internals, in one place.

Owns: the decode batch and padding-free prefill built on mlx-lm's
``BatchGenerator`` / ``GenerationBatch`` private fields (:mod:`.batch`,
:mod:`.prefill`, which also scores a prompt's own tokens for the rows that
ask: ``PromptScores``), the prefix-cache index over mlx-lm's ``PromptTrie``
(:mod:`.prefix_cache`) and its disk tier (:mod:`.disk_cache`: entries as
files in mlx-lm's prompt-cache format with a checksum, :mod:`.cache_file`,
written and read by a background I/O thread), fused CPU kernels and matmul-friendly weights
(:mod:`.fusion`), the quantized matmul primitive ``qmm_ext``
(:mod:`.qmatmul`), the optimized BLAS bound under ``libmlx``
(:mod:`.blas`, loaded first of all by ``import afm_core``, after
glibc's mmap threshold is fixed so freed buffers leave the process:
:mod:`.malloc`), and the Hugging
Face tokenizer inside mlx-lm's ``TokenizerWrapper`` (:mod:`.tokenizer`),
embeddings pooled from the model body's final hidden states
(:mod:`.embeddings`, which calls mlx-lm's ``model.model``), a quantized KV cache
that batches (:mod:`.quantized_cache`: mlx-lm's ``QuantizedKVCache`` rows
and a ``BatchKVCache`` counterpart over its quantized triples, for
``kv_bits``), a float16 KV cache for float32 models (:mod:`.half_cache`,
``kv_dtype``), the CPU attention kernels' entry points (:mod:`.attention`:
decode, and flash-style prefill for prompts) and the MLP's SwiGLU as one
operation (:mod:`.activations`), and the batch
generator of a model sharded over an ``mx.distributed`` group, whose tokens
are sampled on rank 0 and shared (:mod:`.distributed`), and speculative
decoding inside the decode batch (:mod:`.speculative`: prompt lookup and
draft-model proposers, the verify step, the batch cache's trimming).

**The mlx-lm pin.**  ``pyproject.toml`` pins ``mlx-lm==0.32.2`` and
``mlx==0.32.4`` exactly, because the modules here subclass or read private
names (``_generation_batch``, ``_prompt_batch``, ``_unprocessed_sequences``,
the trie's node layout, model attribute names) that mlx-lm may change in any
release, and ``qmm_ext`` compiles against the mlx wheel's headers.  An mlx-lm
bump should touch this folder only: bump the pin, run ``make test``, fix
what fails here.

May import: mlx, mlx-lm, numpy and the standard library (``blas`` must not import
mlx at module level).  Never ``afm_core._engine``, ``_models`` or
``_stream``.
"""
