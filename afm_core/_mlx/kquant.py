"""Linear layers on GGUF's K-quant blocks as they are (Q4_K, Q6_K).

A GGUF conversion writes the Q4_K and Q6_K blocks of a model's linear layers,
byte for byte, beside the model (``kquant.safetensors``,
``afm_core._models.gguf.convert``); the model itself holds the same values
in MLX's affine layout, which mlx-lm and Metal read.  On the CPU with afm's
kernels, :func:`use_kquant_blocks` gives each such layer the blocks instead:
its weight becomes the uint8 rows of blocks, its scales and biases empty,
``group_size`` :data:`~.qmatmul.KQUANT_GROUP` and ``bits`` 4 (Q4_K) or 6
(Q6_K), and its class the fast layer of :mod:`.qmatmul`, whose products
(``ext/qmm/kquant_kernels.cpp``) apply the blocks' integer sub-scales inside
the integer pipeline with one float stage per 256 values.  A 1.5B model's
Q4_K_M file is then read at its own 4.5-6.6 bits a weight instead of the
MLX layout's 5-8.5, the products 1.15-1.4x faster
(``benchmarks/qmm_kquant_probe.cpp``).  Grouping, the norm and rotary
epilogues and the sgemm path (which dequantizes the blocks as llama.cpp
does) work on them as on the MLX layout.

Call it before the model's parameters are evaluated (``mlx_lm.load(...,
lazy=True)``): the MLX layout of the layers it changes is then never read.
``AFM_NO_KQUANT=1`` keeps the MLX layout everywhere.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from . import qmatmul as _qmm

__all__ = ["NO_KQUANT_ENV", "use_kquant_blocks"]

log = logging.getLogger("afm.engine")

NO_KQUANT_ENV = "AFM_NO_KQUANT"
_BITS = {"Q4_K": 4, "Q6_K": 6}


def kquant_wanted() -> bool:
    """Whether layers should take their K-quant blocks: afm's kernels loaded,
    MLX on the CPU, a kernel set with a vectorized K-quant product (every
    x86 set's AVX2 one; the portable one when the scalar set is chosen, as
    the tests of each path do; NEON has none yet, and its MLX-layout
    kernels are the faster there), and not ``AFM_NO_KQUANT``."""
    isa = _qmm.kernel_isa()
    return (isa is not None and isa != "neon" and _qmm._on_cpu()
            and os.environ.get(NO_KQUANT_ENV, "") in ("", "0"))


def use_kquant_blocks(model: nn.Module, path: str | os.PathLike[str]) -> int:
    """Give ``model``'s linear layers the K-quant blocks in the file ``path``
    (where it exists and :func:`kquant_wanted`); returns how many changed.
    A layer the file names but the model does not have as an
    ``nn.QuantizedLinear`` of the same shape keeps its MLX layout."""
    file = Path(path)
    if not file.is_file() or not kquant_wanted():
        return 0
    try:
        loaded = cast(tuple[dict[str, mx.array], dict[str, str]], mx.load(str(file), return_metadata=True))
        arrays, meta = loaded
    except Exception as exc:  # noqa: BLE001 - a damaged file: the MLX layout still works
        log.warning("could not read %s (%s); the model's MLX layout is used", file, exc)
        return 0
    modules = dict(model.named_modules())
    changed = 0
    for key, blocks in arrays.items():
        module = key.removesuffix(".weight")
        layer: Any = modules.get(module)
        bits = _BITS.get(str(meta.get(module, "")))
        if bits is None or type(layer) is not nn.QuantizedLinear or not _fits(layer, blocks, bits):
            log.debug("%s: K-quant blocks not used (the model's layer differs)", module)
            continue
        empty = mx.zeros((blocks.shape[0], 0), dtype=layer["scales"].dtype)
        layer["weight"], layer["scales"], layer["biases"] = blocks, empty, empty
        layer.group_size, layer.bits = _qmm.KQUANT_GROUP, bits
        layer.__class__ = _qmm._FastQuantizedLinear
        changed += 1
    if changed:
        log.info("%d linear layers compute on their GGUF K-quant blocks", changed)
    return changed


def _fits(layer: Any, blocks: mx.array, bits: int) -> bool:
    """Whether ``blocks`` are a weight of ``layer``'s shape (MLX layout)."""
    if blocks.dtype != mx.uint8 or blocks.ndim != 2 or blocks.shape[0] != layer["weight"].shape[0]:
        return False
    size = _qmm.KQUANT_BLOCK_BYTES[bits]
    return blocks.shape[1] % size == 0 and blocks.shape[1] // size * _qmm.KQUANT_GROUP == _qmm.input_dims(layer)
