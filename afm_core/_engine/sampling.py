"""Samplers and logits processors for one request (runs on the MLX thread).

Unseeded requests with equal parameters share one sampler object, so
mlx-lm's ``GenerationBatch`` samples the whole batch in one call.  A seeded
request gets its own sampler with a private PRNG key, so its output does not
depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
    make_sampler,
)

from .._stream.request import ChatRequest, CompletionRequest

Request = ChatRequest | CompletionRequest
"""What the sampling settings are read from (both have the same fields)."""
Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]


class SamplerCache:
    """Shares unseeded samplers between requests with the same parameters."""

    def __init__(self) -> None:
        self._shared: dict[tuple[float, float, float, int], Sampler] = {}

    def get(self, req: Request, vocab_size: int) -> Sampler:
        if req.temperature == 0.0:
            return greedy_sampler
        # top_k at or beyond the vocabulary keeps every token: no filter at all
        top_k = req.top_k if req.top_k < vocab_size else 0
        key = (req.temperature, req.top_p, req.min_p, top_k)
        if req.seed is not None:
            return _seeded_sampler(req, req.seed, top_k)
        sampler = self._shared.get(key)
        if sampler is None:
            sampler = make_sampler(temp=req.temperature, top_p=req.top_p, min_p=req.min_p, top_k=top_k)
            self._shared[key] = sampler
        return sampler


def _seeded_sampler(req: Request, seed: int, top_k: int) -> Sampler:
    key = mx.random.key(seed % (2**63))
    state = [key]
    temp, top_p, min_p = req.temperature, req.top_p, req.min_p

    def sampler(logprobs: mx.array) -> mx.array:
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p:
            logprobs = apply_min_p(logprobs, min_p, 1)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        state[0], sub = mx.random.split(state[0])
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sampler


def logits_processors(req: Request, vocab_size: int) -> list[Processor]:
    """OpenAI penalties and logit_bias as mlx-lm logits processors."""
    bias = {t: b for t, b in req.logit_bias.items() if t < vocab_size}
    return make_logits_processors(
        logit_bias=bias or None,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty != 1.0 else None,
        presence_penalty=req.presence_penalty or None,
        frequency_penalty=req.frequency_penalty or None,
    )


class GuardedProcessor:
    """Runs a per-request processor and records (not raises) its failure.

    An exception inside one request's logits processing must fail only that
    request: the worker checks ``error`` after each step and ends the stream.
    """

    __slots__ = ("error", "inner")

    def __init__(self, inner: Processor):
        self.inner = inner
        self.error: BaseException | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.error is not None:
            return logits
        try:
            return self.inner(tokens, logits)
        except Exception as exc:  # noqa: BLE001 - isolated per request
            self.error = exc
            return logits


def top_logprobs(logprobs: mx.array, k: int) -> tuple[list[int], list[float]]:
    """The ``k`` most likely token ids and their logprobs, best first."""
    if k <= 0:
        return [], []
    idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    ids: Any = idx[order].tolist()
    values: Any = vals[order].tolist()
    return ids, values
