"""Text embeddings from a causal language model's final hidden states.

:func:`embed` runs mlx-lm's transformer body (``model.model``: the token
embedding, the layers and the final norm, without the LM head) over token
sequences and pools each sequence's hidden states into one L2-normalized
vector, as llama.cpp's server does for ``/v1/embeddings``:

``mean``
    the average over the sequence's tokens (the default);
``last``
    the last token's state (the pooling of decoder-only embedding models,
    which end their input with an end-of-sequence token);
``cls``
    the first token's state.

Sequences are run together in groups, right-padded: attention is causal, so
a real position never sees the padding after it, and only real positions
are pooled; a text's vector is the same alone and in a group up to float
rounding.  Must run on the generation thread (MLX streams are thread-local).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["POOLINGS", "NoHiddenStates", "embed", "has_body"]

POOLINGS = ("mean", "last", "cls")
"""The pooling methods :func:`embed` knows."""

GROUP_TOKENS = 8192
"""Padded tokens (rows times the longest row) run in one forward pass at most."""


class NoHiddenStates(Exception):
    """The model has no transformer body that returns hidden states."""


def has_body(model: Any) -> bool:
    """Whether ``model`` has mlx-lm's ``model.model`` body (the echo test model has none)."""
    return callable(getattr(model, "model", None))


def embed(model: Any, token_lists: Sequence[Sequence[int]], pooling: str = "mean") -> list[list[float]]:
    """One L2-normalized vector per token list (see the module docstring).

    Raises :class:`NoHiddenStates` for a model without a body and
    :class:`ValueError` for an unknown pooling or an empty token list.
    """
    import mlx.core as mx

    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r} (one of {', '.join(POOLINGS)})")
    if any(len(t) == 0 for t in token_lists):
        raise ValueError("an input has no tokens")
    if not has_body(model):
        raise NoHiddenStates("this model has no transformer body returning hidden states")
    body = model.model
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    out: list[list[float] | None] = [None] * len(token_lists)
    start = 0
    while start < len(order):
        end = start + 1
        # sorted by length: the group's longest row is its last
        while end < len(order) and (end + 1 - start) * len(token_lists[order[end]]) <= GROUP_TOKENS:
            end += 1
        group = order[start:end]
        width = len(token_lists[group[-1]])
        rows = [list(token_lists[i]) + [0] * (width - len(token_lists[i])) for i in group]
        hidden = body(mx.array(rows, dtype=mx.int32))
        if not isinstance(hidden, mx.array) or hidden.ndim != 3 or hidden.shape[:2] != (len(group), width):
            raise NoHiddenStates("this model's body does not return hidden states [batch, tokens, hidden]")
        hidden = hidden.astype(mx.float32)
        pooled = []
        for r, i in enumerate(group):
            n = len(token_lists[i])
            if pooling == "mean":
                v = mx.mean(hidden[r, :n], axis=0)
            elif pooling == "last":
                v = hidden[r, n - 1]
            else:
                v = hidden[r, 0]
            pooled.append(v)
        vectors = mx.stack(pooled)
        norms = mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
        vectors = vectors / norms
        mx.eval(vectors)
        for r, i in enumerate(group):
            out[i] = vectors[r].tolist()  # type: ignore[assignment]
        start = end
    return [v for v in out if v is not None]
