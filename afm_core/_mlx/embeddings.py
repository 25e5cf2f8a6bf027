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

:class:`EmbeddingRun` does the same work a budget of tokens at a time, so the
generation thread can run it between decode steps without stalling the
streams it decodes: :meth:`EmbeddingRun.step` runs whole short inputs
together while they fit in the budget, and a longer input in slices through
a KV cache (mlx-lm's ``make_prompt_cache``; the slices' pooled sums add up
to the whole input's, up to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["POOLINGS", "EmbeddingRun", "NoHiddenStates", "embed", "has_body"]

POOLINGS = ("mean", "last", "cls")
"""The pooling methods :func:`embed` knows."""

GROUP_TOKENS = 8192
"""Padded tokens (rows times the longest row) run in one forward pass at most."""


class NoHiddenStates(Exception):
    """The model has no transformer body that returns hidden states."""


def has_body(model: Any) -> bool:
    """Whether ``model`` has mlx-lm's ``model.model`` body (the echo test model has none)."""
    return callable(getattr(model, "model", None))


def _check(model: Any, token_lists: Sequence[Sequence[int]], pooling: str) -> None:
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r} (one of {', '.join(POOLINGS)})")
    if any(len(t) == 0 for t in token_lists):
        raise ValueError("an input has no tokens")
    if not has_body(model):
        raise NoHiddenStates("this model has no transformer body returning hidden states")


def embed(model: Any, token_lists: Sequence[Sequence[int]], pooling: str = "mean") -> list[list[float]]:
    """One L2-normalized vector per token list (see the module docstring).

    Raises :class:`NoHiddenStates` for a model without a body and
    :class:`ValueError` for an unknown pooling or an empty token list.
    """
    import mlx.core as mx

    _check(model, token_lists, pooling)
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


def _hidden(body: Any, rows: Any, cache: Any = None) -> Any:
    import mlx.core as mx

    hidden = body(rows) if cache is None else body(rows, cache=cache)
    if not isinstance(hidden, mx.array) or hidden.ndim != 3 or hidden.shape[:2] != tuple(rows.shape):
        raise NoHiddenStates("this model's body does not return hidden states [batch, tokens, hidden]")
    return hidden.astype(mx.float32)


def _normalized(v: Any) -> list[float]:
    import mlx.core as mx

    v = v / mx.maximum(mx.linalg.norm(v), 1e-12)
    mx.eval(v)
    out: list[float] = v.tolist()
    return out


class EmbeddingRun:
    """One call's embeddings, computed at most ``budget`` tokens per :meth:`step`
    (see the module docstring).  Raises as :func:`embed` does, from the
    constructor (bad input) or from :meth:`step` (the model's failure)."""

    def __init__(self, model: Any, token_lists: Sequence[Sequence[int]], pooling: str = "mean") -> None:
        _check(model, token_lists, pooling)
        self.body = model.model
        self.model = model
        self.token_lists = [list(t) for t in token_lists]
        self.pooling = pooling
        # shortest first: the more inputs share a padded group, the less padding
        self._todo = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
        self._vectors: list[list[float] | None] = [None] * len(token_lists)
        self._long: tuple[int, Any, int, Any] | None = None  # (input, cache, done, pooled so far)
        self.tokens_done = 0

    @property
    def done(self) -> bool:
        return not self._todo and self._long is None

    def result(self) -> list[list[float]]:
        """The vectors, in the inputs' order (once :attr:`done`)."""
        assert self.done
        return [v for v in self._vectors if v is not None]

    def step(self, budget: int) -> bool:
        """Compute up to ``budget`` tokens (at least one slice); True when done."""
        spent = 0
        while not self.done and (spent == 0 or spent < budget):
            if self._long is not None:
                spent += self._slice(max(budget - spent, 1))
                continue
            group = self._group(max(budget - spent, 1))
            if group:
                spent += self._run_group(group)
            else:  # the next input does not fit: through a cache, a slice at a time
                from mlx_lm.models.cache import make_prompt_cache

                self._long = (self._todo.pop(0), make_prompt_cache(self.model), 0, None)
        return self.done

    def _group(self, room: int) -> list[int]:
        """The next inputs that fit in ``room`` padded tokens together (and in
        ``GROUP_TOKENS``), shortest first; empty when not even one does."""
        group: list[int] = []
        for i in self._todo:
            width = len(self.token_lists[i])  # the longest so far: sorted
            if (len(group) + 1) * width > min(room, GROUP_TOKENS):
                break
            group.append(i)
        del self._todo[:len(group)]
        return group

    def _run_group(self, group: list[int]) -> int:
        import mlx.core as mx

        width = len(self.token_lists[group[-1]])
        rows = mx.array([self.token_lists[i] + [0] * (width - len(self.token_lists[i])) for i in group],
                        dtype=mx.int32)
        hidden = _hidden(self.body, rows)
        for r, i in enumerate(group):
            n = len(self.token_lists[i])
            v = mx.mean(hidden[r, :n], axis=0) if self.pooling == "mean" \
                else hidden[r, n - 1] if self.pooling == "last" else hidden[r, 0]
            self._vectors[i] = _normalized(v)
        self.tokens_done += sum(len(self.token_lists[i]) for i in group)
        return len(group) * width

    def _slice(self, room: int) -> int:
        import mlx.core as mx

        assert self._long is not None
        i, cache, at, pooled = self._long
        tokens = self.token_lists[i]
        piece = tokens[at:at + room]
        hidden = _hidden(self.body, mx.array([piece], dtype=mx.int32), cache)[0]
        if self.pooling == "mean":
            part = mx.sum(hidden, axis=0)
            pooled = part if pooled is None else pooled + part
        elif self.pooling == "last":
            pooled = hidden[-1]
        elif pooled is None:
            pooled = hidden[0]
        mx.eval(pooled, *[c.state for c in cache])
        at += len(piece)
        self.tokens_done += len(piece)
        if at < len(tokens):
            self._long = (i, cache, at, pooled)
        else:
            self._vectors[i] = _normalized(pooled / len(tokens) if self.pooling == "mean" else pooled)
            self._long = None
        return len(piece)
