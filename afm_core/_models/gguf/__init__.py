"""GGUF files into mlx-lm model directories.

``reader`` (the header and zero-copy tensor views; types and block sizes from
the ``gguf`` package), ``quants`` (each GGML type onto MLX's affine layout),
``arch/`` (one module per architecture family: names, config, row orders),
``tokenizer`` (the tokenizer files from the file's metadata), ``convert``
(the whole conversion, atomic) and ``cli`` (``afm convert-gguf``).

May import: :mod:`afm_core._mlx` (the quantized kernel's availability),
:mod:`afm_core._errors`, mlx, numpy and ``gguf``.
"""
