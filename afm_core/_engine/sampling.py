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
)

from .._stream.events import StreamFailure
from ..api.chat_request import ChatRequest
from ..api.completions_request import CompletionRequest

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
            return FilteredSampler(req.temperature, req.top_p, req.min_p, top_k, seed=req.seed)
        sampler = self._shared.get(key)
        if sampler is None:
            sampler = FilteredSampler(req.temperature, req.top_p, req.min_p, top_k)
            self._shared[key] = sampler
        return sampler


class FilteredSampler:
    """mlx-lm's ``make_sampler`` (top_p, min_p, top_k, then temperature)
    that also exposes the distribution it draws from.

    Speculative sampling (``afm_core._mlx.speculative``) needs the row's
    filtered distribution at several positions, not one draw: :meth:`distribution`
    gives its log-weights, :meth:`keys` the random keys of one verify step.
    With a ``seed`` the sampler owns a PRNG key (its output does not depend on
    what else is in the batch, and the same seed gives the same tokens);
    without one it draws from MLX's global generator, as ``make_sampler`` does.
    """

    __slots__ = ("_key", "min_p", "temp", "top_k", "top_p")

    def __init__(self, temp: float, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0,
                 *, seed: int | None = None) -> None:
        self.temp, self.top_p, self.min_p, self.top_k = temp, top_p, min_p, top_k
        self._key = None if seed is None else mx.random.key(seed % (2**63))

    def distribution(self, logprobs: mx.array) -> mx.array:
        """Log-weights (unnormalized) of the tokens this sampler draws, per row of ``logprobs``."""
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p:
            logprobs = apply_min_p(logprobs, self.min_p, 1)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs * (1.0 / self.temp)

    @property
    def seeded(self) -> bool:
        """Whether the sampler draws from its own seeded key."""
        return self._key is not None

    def _next_key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, sub = mx.random.split(self._key)
        return sub

    def keys(self) -> tuple[mx.array | None, mx.array | None]:
        """Two keys for one verify step (acceptance draws, token draws); None: the global generator."""
        sub = self._next_key()
        if sub is None:
            return None, None
        a, b = mx.random.split(sub)
        return a, b

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.random.categorical(self.distribution(logprobs), key=self._next_key())


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

    def valid_prefix(self, tokens: mx.array, guess: list[int]) -> int:
        """How many tokens of a speculative ``guess`` after ``tokens`` the
        processor allows (all, unless it keeps state: the grammar's)."""
        check = getattr(self.inner, "valid_prefix", None)
        if check is None or self.error is not None:
            return len(guess)
        try:
            n: int = check(tokens, guess)
        except Exception as exc:  # noqa: BLE001 - isolated per request
            self.error = exc
            return 0
        return n

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens a stateful processor saw (guesses not accepted)."""
        undo = getattr(self.inner, "rollback", None)
        if undo is None or self.error is not None:
            return
        try:
            undo(n)
        except Exception as exc:  # noqa: BLE001 - isolated per request
            self.error = exc


def guard_failure(exc: BaseException) -> StreamFailure:
    """The event ending a stream whose processor failed: a grammar that could
    not go on is the client's (``invalid_request_error``), anything else ours."""
    from .grammar import GrammarFailure

    if isinstance(exc, GrammarFailure):
        return StreamFailure(str(exc), type="invalid_request_error", code="grammar_too_complex")
    return StreamFailure(f"generation failed: {exc}")


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
