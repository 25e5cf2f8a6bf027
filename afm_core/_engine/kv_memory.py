"""What a model's weights and KV cache take, from its config: the sizes the
generation thread chooses the prefix cache's budget by and profiles report."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.nn as nn

PREFIX_CACHE_CAP = 1 << 30
"""The most the prefix cache's memory tier keeps when its budget is sized to the model."""

PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Numbers: 3.14159, 2718, -42.\n"
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Traduis en français : « bonjour », 日本語のテキスト, {\"key\": [1, 2, 3]}"
)
"""Text whose keys and values ``kv_dtype="auto"`` checks against float16's range."""


def param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters."""
    from mlx.utils import tree_flatten

    # mlx annotates list-or-dict; without ``destination`` it is always the list of pairs
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return sum(v.nbytes for _, v in flat)


BUFFER_CACHE_ENV = "AFM_MLX_CACHE_MIB"
BUFFER_CACHE_MAX = 32 << 20
"""MLX's own default for the CPU: the most its cache of freed buffers keeps."""
BUFFER_CACHE_MIN = 8 << 20


def buffer_cache_bytes(weights: int, environ: dict[str, str] | None = None) -> int:
    """How many bytes of freed buffers MLX may keep for reuse
    (``mx.set_cache_limit``) beside a model of ``weights`` bytes: an eighth
    of them, between 8 and 32 MiB (MLX's default), or ``AFM_MLX_CACHE_MIB``.

    The cache saves a prompt chunk's large buffers the mapping and page
    faults of a fresh allocation, and what it holds is resident: at MLX's
    32 MiB, the default model's (97 MiB of weights) peak at an 8,000-token
    prompt was 25 MiB higher than at 8, for 3% of the prompt's time
    (``benchmarks/memory.py``).  Larger models keep MLX's 32 MiB."""
    import os

    env = (os.environ if environ is None else environ).get(BUFFER_CACHE_ENV, "")
    if env:
        return max(0, int(env)) << 20
    return min(BUFFER_CACHE_MAX, max(BUFFER_CACHE_MIN, weights // 8))


def vocab_size(model: nn.Module) -> int:
    """The model's vocabulary size from its config (a huge number if it gives none)."""
    args = getattr(model, "args", None)
    return int(getattr(args, "vocab_size", 0) or 1 << 30)


def context_length(model: nn.Module) -> int:
    """The model's context length from its config (0 if it gives none)."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "n_ctx", "context_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def kv_bytes_per_token(model: nn.Module, kv_bits: int | None = None, group_size: int = 64,
                       half: bool = False) -> int:
    """K and V bytes one token adds to the cache (estimate from the config:
    float32 (float16 with ``half``), or ``kv_bits`` per element plus a
    float32 scale and bias per ``group_size`` elements)."""
    args = getattr(model, "args", None)
    if args is None:
        return 0
    layers = getattr(args, "num_hidden_layers", 0) or len(getattr(model, "layers", []))
    heads = getattr(args, "num_key_value_heads", None) or getattr(args, "num_attention_heads", 0) or 0
    hidden = getattr(args, "hidden_size", 0) or 0
    n_heads = getattr(args, "num_attention_heads", 0) or 1
    head_dim = getattr(args, "head_dim", None) or (hidden // n_heads if hidden else 0)
    per_element = (2.0 if half else 4.0) if kv_bits is None else kv_bits / 8 + 2 * 4 / group_size
    return int(2 * layers * heads * head_dim * per_element)


def default_prefix_budget(model: nn.Module, kv_bits: int | None, group_size: int, half: bool) -> int:
    """The memory tier's budget when none is given: the KV cache of one request
    filling the model's context, at most :data:`PREFIX_CACHE_CAP`."""
    context = context_length(model)
    per_token = kv_bytes_per_token(model, kv_bits, group_size, half=half)
    return min(PREFIX_CACHE_CAP, per_token * context) if per_token and context else PREFIX_CACHE_CAP
