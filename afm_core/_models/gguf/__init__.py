"""GGUF files: a pure header reader, the tokenizer rebuild, the converter to mlx-lm.

May import: :mod:`afm_core._mlx` (the quantized kernel's availability),
:mod:`afm_core._errors`, mlx.
"""
