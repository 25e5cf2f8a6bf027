"""Speculative decoding inside the engine's decode batch.

A *proposer* guesses the next few tokens of a row; one forward pass of the
target model over ``[current token, guess_1 .. guess_k]`` (the *verify step*)
gives the target's distribution at each of those positions, and the
longest prefix of the guess the target accepts is emitted at once, with a
token of the target's after it.  Output is the target's own (the same greedy
tokens; for a sampled row the same distribution); on this CPU a forward of
k+1 tokens costs much less than k+1 single-token steps (a small model's
step is mostly per-operation overhead), so every accepted guess is a step
saved.

Two proposers (one per engine, behind the same verify step):

* :class:`PromptLookup`: the last ``n`` tokens of the row (its prompt and
  output), found earlier in the same row (``n`` from ``NGRAM_MAX`` down to
  ``NGRAM_MIN``; the latest match with ``k`` tokens after it, else the one
  with the most), propose the tokens that followed them there.  No model, no state; nothing proposed (no cost) when nothing matches.
* :class:`DraftModel`: a smaller model with the same tokenizer proposes its
  own greedy continuation, one single-token step of the draft per proposed
  token.  Each row has its own draft cache (single-sequence, mlx-lm's
  ``make_prompt_cache``), keyed by the row's uid, filled lazily with the
  row's tokens when it first speculates, trimmed back to what the target
  accepted after every verify step, and dropped when the row leaves the
  batch (:meth:`Speculation.retain`, from the batch's ``filter``).

**When a step speculates** (:meth:`Speculation.step`): the decode batch has
at most ``max_batch`` rows, every layer's cache is trimmable (mlx-lm's
``BatchKVCache`` or the quantized :class:`~.quantized_cache.BatchQuantizedKVCache`),
and at least one row is *eligible* and got a proposal.  A row is eligible
when its sampler is greedy or exposes its distribution (``distribution`` and
``keys``: ``afm_core._engine.sampling.FilteredSampler``, every sampled
request's).  Rows that propose nothing (resting, no match, another
sampler) still run in the verify pass: their position 0 goes through the
batch's normal processors, log-probabilities and sampler, exactly as in a
plain step, so a batch never has to choose between speculation and its
other requests.  Above ``max_batch`` rows the plain batched step runs; the
choice is made again before every step.  Each row's LoRA adapter
(``batch.adapters``) is selected for all of its positions.

**Acceptance** (:meth:`Speculation._draw`).  At position ``j`` the row's
logits go through its logits processors fed its tokens, the current one
and ``guess[:j]`` (what a plain step at that position would feed them).  A
greedy row accepts the guess while it equals the argmax.  A sampled row
uses speculative sampling with a deterministic proposal (a point mass):
guess ``x_j`` is accepted with probability ``p_j(x_j)``, ``p_j`` the
sampler's distribution there (filters and temperature applied); at the
first rejection the token is drawn from ``p_j`` without ``x_j``,
renormalized; after the whole guess, from the next position's ``p``.  Each
token then has exactly the distribution of a plain step's draw.  A seeded
sampler gives the step's random draws from its own key, so the same seed
gives the same tokens again.

**Stateful processors** (the grammar, ``afm_core._engine.grammar``) offer
``valid_prefix(tokens, guess)`` and ``rollback(n)``: a guess is cut before
its first token the grammar forbids (never accepted, and the grammar
cannot advance past it to mask the next positions), and after the verify
step the grammar forgets the guessed tokens that were not accepted.  Other
processors (penalties, ``logit_bias``) are functions of the tokens they are
given.  Rows reading log-probabilities get each emitted token's from its
position of the verify pass (after processors, as a plain step's).

**The cache after a verify step.**  Every row computed ``1 + K`` positions
(``K`` the longest proposal, at most :func:`verify_rows` rows in all; shorter
ones are padded); row ``i`` keeps ``1 +
a_i`` (``a_i`` accepted).  All rows are trimmed by the smallest surplus
(``BatchKVCache.trim``); a row with more surplus is rolled right by the rest,
which becomes left padding (mlx-lm's own ``prepare(right_padding=...)`` /
``finalize()``, as after its right-padded prefill).

**Emission.**  A row's accepted tokens come back from the batch's ``next``
as several ``GenerationBatch.Response`` of the same uid, in order, each
passing the row's ``max_tokens`` and stop matcher as a plain step's token
does; a row that finishes within them drops the rest (and its saved cache
is trimmed to the tokens it emitted).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from . import half_cache
from . import qmatmul as _qmm
from .batch import process_rows
from .quantized_cache import BatchQuantizedKVCache

if TYPE_CHECKING:
    from .batch import EngineGenerationBatch

log = logging.getLogger("afm.engine")

__all__ = ["AUTO_LOOKUP_MIN_BYTES", "AUTO_LOOKUP_TOKENS", "AUTO_LOOKUP_TOKENS_VNNI", "NGRAM_MAX", "NGRAM_MIN",
           "DraftModel", "PromptLookup", "Proposer", "Speculation", "auto_lookup_tokens", "lookup_tokens_for",
           "untrimmable_layers", "weight_bytes"]

NGRAM_MAX = 3
"""Longest suffix :class:`PromptLookup` looks for."""
NGRAM_MIN = 2
"""Shortest: one token alone matches too often to guess well."""

AUTO_LOOKUP_TOKENS = 2
"""Tokens prompt lookup proposes per step when it is on by default
(``EngineConfig.prompt_lookup`` None) and the kernels' integer products
are not one instruction per block (AVX2 without VNNI, the portable loop, no
compiled kernels: MLX's own products): :func:`auto_lookup_tokens`.  There
the products over a verify pass's rows are bound by the multiply ports (on
an AVX2-only EPYC a pass over 5 positions of Qwen2.5-Coder-1.5B cost about
two plain steps, and 4 proposed tokens made chat 0.95x plain; 2 tokens
gave chat 1.20x and code editing 1.25x, ``afm bench --speculation``)."""
AUTO_LOOKUP_TOKENS_VNNI = 4
"""The same where the kernels have VNNI's one-instruction dot product
(``avx512-vnni``, ``avx2-vnni``): a pass over 5 positions costs little more
than one step (AVX-512 VNNI: chat 1.27x plain, code editing 1.70x).  The
``avx2-vnni`` set (AVX-VNNI on 256-bit registers) is put here by its
arithmetic, not a measurement: its products of a few rows cost what
AVX-512's do per lane."""
AUTO_LOOKUP_MIN_BYTES = 256 << 20
"""Weights (bytes) from which prompt lookup is on by default.  A decode step
of such a model is bound by reading its weights, so a verify pass over a few
positions, which reads them once, costs little more than one step, and it
paid on every workload measured, free prose too (``afm bench
--speculation``: Qwen2.5-Coder 0.5B and 1.5B, chat and code editing).  A
smaller model's step is mostly per-operation overhead, its verify pass of 5
positions costs ~1.6 of a step, and on prose (few guesses accepted) it lost
a few percent (the default model, ``benchmarks/speculative.py``)."""

MAX_REST = 16
"""Most steps a row whose guesses keep missing goes without proposing."""

_STEP_TIMEOUT = 2.0
"""Seconds between two steps beyond which the engine was idle between them
(not counted as a step's time)."""

_TRIMMABLE = (BatchKVCache, BatchQuantizedKVCache, half_cache.BatchKVCache)
"""Batch caches a verify step can trim back."""


def untrimmable_layers(model: Any) -> list[str]:
    """The class names of ``model``'s cache layers a verify step could not
    trim back (sliding windows, recurrent state: Gemma 3's, say), each once;
    empty when the model can speculate."""
    return sorted({type(c).__name__ for c in make_prompt_cache(model)
                   if type(c) not in (KVCache, QuantizedKVCache)})


def verify_rows() -> int:
    """Most rows (streams x positions) a verify step computes: fewer than the
    rows from which the quantized product dequantizes whole weights for a BLAS
    product (``qmm_ext.gemm_rows()``: 64 on AVX-512 VNNI, else 32; see
    ``afm_core._mlx.qmatmul``), the right trade for a prefill chunk and a loss
    for a few verify positions (on the default model 8 streams x 5 positions
    once took 2.5 s against 0.13 s for 8 x 1), and the integer kernels give
    each row the bits one-row decoding gives it.  Wider batches get shorter
    proposals.  Without the extension, no bound."""
    ext = _qmm.extension()
    rows = ext.gemm_rows() if ext is not None else 0
    return rows - 1 if rows > 1 else 1 << 20


def weight_bytes(model: Any) -> int:
    """Bytes of ``model``'s parameters (quantized weights with their scales
    and biases): about what one decode step reads."""
    from mlx.utils import tree_flatten

    leaves: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return sum(int(v.nbytes) for _, v in leaves if isinstance(v, mx.array))


def auto_lookup_tokens(model: Any, min_bytes: int | None = None, isa: str | None = "") -> int:
    """Prompt lookup's tokens per step by default for ``model``: from
    ``min_bytes`` (:data:`AUTO_LOOKUP_MIN_BYTES`) of weights on, 0 (off)
    below; :data:`AUTO_LOOKUP_TOKENS_VNNI` with the kernel set ``isa``
    (``""``: the one in use, ``qmatmul.kernel_isa()``; None: no compiled
    kernels) where it has VNNI, else :data:`AUTO_LOOKUP_TOKENS`."""
    floor = AUTO_LOOKUP_MIN_BYTES if min_bytes is None else min_bytes
    return lookup_tokens_for(isa) if weight_bytes(model) >= floor else 0


def lookup_tokens_for(isa: str | None = "") -> int:
    """Tokens the automatic setting proposes per step with the kernel set
    ``isa`` (``""``: the one in use; None: no compiled kernels):
    :data:`AUTO_LOOKUP_TOKENS_VNNI` where it has VNNI, else
    :data:`AUTO_LOOKUP_TOKENS`."""
    if isa == "":
        isa = _qmm.kernel_isa()
    return AUTO_LOOKUP_TOKENS_VNNI if isa is not None and "vnni" in isa else AUTO_LOOKUP_TOKENS


class Proposer(Protocol):
    """Guesses up to ``k`` tokens after ``tokens`` (a row's prompt and output)."""

    def propose(self, uid: int, tokens: list[int], k: int) -> list[int]: ...

    def accepted(self, uid: int, n_tokens: int, proposed: int, accepted: int) -> None:
        """The target accepted ``accepted`` of the ``proposed`` tokens guessed
        after ``n_tokens`` tokens."""

    def retain(self, uids: Iterable[int]) -> None:
        """Only ``uids`` are still in the batch."""


class PromptLookup:
    """N-gram lookup in the row's own tokens (see the module docstring)."""

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, uid: int, tokens: list[int], k: int) -> list[int]:
        return lookup(tokens, k, self.ngram_max, self.ngram_min)

    def accepted(self, uid: int, n_tokens: int, proposed: int, accepted: int) -> None:
        pass

    def retain(self, uids: Iterable[int]) -> None:
        pass


def lookup(tokens: list[int], k: int, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the
    longest suffix of ``tokens`` (``ngram_max`` down to ``ngram_min`` long)."""
    n_all = len(tokens)
    if k <= 0 or n_all <= ngram_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # where the last token occurred before (with a token after it), latest first
    ends = np.flatnonzero(arr[:-1] == arr[-1])[::-1]
    for n in range(min(ngram_max, n_all - 1), ngram_min - 1, -1):
        suffix = arr[n_all - n:]
        best = -1
        for e in ends.tolist():
            if e - n + 1 < 0 or not np.array_equal(arr[e - n + 1 : e + 1], suffix):
                continue
            if best < 0 or n_all - 1 - e > n_all - 1 - best:
                best = e  # the latest match with the most tokens after it (up to k)
            if n_all - 1 - e >= k:
                break
        if best >= 0:
            return [int(t) for t in arr[best + 1 : best + 1 + k]]
    return []


@dataclass(slots=True)
class _DraftRow:
    cache: list[Any]
    n: int = 0
    """Tokens of the row the cache holds (a prefix of the row's tokens)."""


class DraftModel:
    """A smaller model's greedy guess (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows: dict[int, _DraftRow] = {}

    def propose(self, uid: int, tokens: list[int], k: int) -> list[int]:
        row = self.rows.get(uid)
        if row is None:
            row = self.rows[uid] = _DraftRow(make_prompt_cache(self.model))
        if k <= 0:
            return []
        y = mx.array(tokens[row.n :], dtype=mx.uint32)[None]
        guesses = []
        for j in range(k):  # lazily: each guess feeds the next step, one evaluation at the end
            logits = self.model(y, cache=row.cache)[:, -1, :]
            t = mx.argmax(logits, axis=-1)
            guesses.append(t)
            if j < k - 1:
                y = t[None]
        out = mx.concatenate(guesses)
        mx.eval(out, [c.state for c in row.cache])
        row.n = len(tokens) + k - 1
        ids: list[int] = out.tolist()  # type: ignore[assignment]  # 1-D: a list of ints
        return ids

    def accepted(self, uid: int, n_tokens: int, proposed: int, accepted: int) -> None:
        row = self.rows.get(uid)
        if row is None:
            return
        keep = n_tokens + min(accepted, max(proposed - 1, 0))
        if row.n > keep:
            for c in row.cache:
                c.trim(row.n - keep)
            row.n = keep

    def retain(self, uids: Iterable[int]) -> None:
        live = set(uids)
        for uid in [u for u in self.rows if u not in live]:
            del self.rows[uid]


@dataclass(slots=True)
class Speculation:
    """Speculative decoding settings and counters of one decode batch."""

    proposer: Proposer
    tokens: int
    """Most tokens proposed per row and step (``k``)."""
    max_batch: int
    """Most decoding rows a step speculates with (see the module docstring)."""
    seeded: bool = True
    """Whether rows sampled with a ``seed`` speculate.  Their tokens then depend
    on which of their steps verify (the other streams, the measured step
    times), so the automatic default (``EngineConfig.prompt_lookup`` None)
    leaves them out: a seed gives the same tokens whatever else runs."""
    steps: int = 0
    """Verify steps run."""
    proposed: int = 0
    accepted: int = 0
    by_uid: dict[int, list[int]] = field(default_factory=dict)
    """uid -> [proposed, accepted] of that row (taken by the engine at its end)."""
    misses: dict[int, int] = field(default_factory=dict)
    """uid -> verify steps in a row that rejected the whole proposal."""
    resting: dict[int, int] = field(default_factory=dict)
    """uid -> steps the row still proposes nothing for (see :meth:`_rest`)."""
    gain: dict[int, float] = field(default_factory=dict)
    """uid -> moving average of the tokens its verify steps accepted."""
    step_seconds: dict[tuple[int, bool], float] = field(default_factory=dict)
    """(rows, verify step?) -> moving average of such a step's wall time."""
    _clock: float = 0.0
    _last: tuple[int, bool] | None = None

    def _timed(self, rows: int) -> None:
        """Time the step that ran since the last call (a step's wall time is the
        time from one step to the next: a plain step's overlaps the next one's
        graph building, a verify step waits for its results)."""
        now = time.perf_counter()
        last, self._last = self._last, None
        if last is not None and last[0] == rows and now - self._clock < _STEP_TIMEOUT:
            seen = self.step_seconds.get(last)
            took = now - self._clock
            self.step_seconds[last] = took if seen is None else seen + (took - seen) / 4
        self._clock = now

    def needed(self, rows: int) -> float:
        """Tokens a verify step of ``rows`` rows must accept (on average) to pay
        for itself: its time over a plain step's, minus the one token a plain
        step gives.  0 until both have been timed."""
        plain = self.step_seconds.get((rows, False))
        verify = self.step_seconds.get((rows, True))
        if not plain or not verify:
            return 0.0
        return max(verify / plain - 1.0, 0.0)

    def retain(self, uids: Iterable[int]) -> None:
        live = set(uids)
        self.proposer.retain(live)
        for d in (self.misses, self.resting, self.gain):
            for uid in [u for u in d if u not in live]:
                del d[uid]

    def _rest(self, uid: int, accepted: int, needed: float) -> None:
        """Back off a row whose guesses do not pay: after ``m`` verify steps in
        a row that missed, it proposes nothing for ``2**m - 1`` steps (at most
        ``MAX_REST``), which run as plain steps when no row proposes.  A verify
        step costs more than a plain one, so text that the proposer cannot
        guess (most chat) must not pay for one every step.  A step misses when
        it accepted nothing, or when the row's moving average of accepted tokens
        is at most what a verify step must accept to pay for itself
        (:meth:`needed`, from the steps' measured times)."""
        seen = self.gain.get(uid)
        avg = self.gain[uid] = accepted if seen is None else (seen + accepted) / 2
        if accepted and avg > needed:
            self.misses.pop(uid, None)
            return
        m = self.misses.get(uid, 0) + 1
        self.misses[uid] = m
        self.resting[uid] = min((1 << m) - 1, MAX_REST)

    def _resting(self, uid: int) -> bool:
        left = self.resting.get(uid)
        if not left:
            return False
        if left == 1:
            del self.resting[uid]
        else:
            self.resting[uid] = left - 1
        return True

    def take(self, uid: int) -> tuple[int, int]:
        """``uid``'s counts, forgotten here."""
        p, a = self.by_uid.pop(uid, (0, 0))
        return p, a

    def step(self, batch: EngineGenerationBatch) -> list[Any] | None:
        """One verify step of ``batch`` (its responses), or None: a plain step is due."""
        n = len(batch.uids)
        self._timed(n)
        self._last = (n, False)  # until a verify step runs
        cap = min(self.tokens, verify_rows() // max(n, 1) - 1)
        if n == 0 or n > self.max_batch or cap < 1:
            return None
        if not all(type(c) in _TRIMMABLE for c in batch.prompt_cache):
            return None
        eligible = [_speculates(s) and (self.seeded or not getattr(s, "seeded", False))
                    for s in (_sampler(batch, i) for i in range(n))]
        if not any(eligible):
            return None
        # the rows that propose this step; with none, the plain step runs without
        # waiting here for the step in flight (reading the current tokens would)
        room = [min(cap, batch.max_tokens[i] - batch._num_tokens[i] - 1) for i in range(n)]
        asking = [i for i in range(n) if eligible[i] and not self._resting(batch.uids[i]) and room[i] > 0]
        if not asking:
            return None
        inputs: mx.array = batch._next_tokens
        mx.eval(inputs)
        current: list[int] = inputs.tolist()  # type: ignore[assignment]  # 1-D: a list of ints
        proposals: list[list[int]] = [[] for _ in range(n)]
        for i in asking:
            guess = self.proposer.propose(batch.uids[i], [*batch.tokens[i], current[i]], room[i])[:room[i]]
            if guess and _processors(batch, i):
                guess = self._allowed(batch, i, inputs, guess)
            proposals[i] = guess
        width = max(len(p) for p in proposals)
        if width == 0:
            return None
        return self._verify(batch, inputs, current, proposals, width)

    def _allowed(self, batch: EngineGenerationBatch, i: int, inputs: mx.array, guess: list[int]) -> list[int]:
        """The part of row ``i``'s ``guess`` its stateful processors (a grammar)
        allow: a guess the grammar forbids is never accepted, and the grammar
        cannot be advanced past it to mask the positions after it."""
        keep = len(guess)
        context = None
        for p in _processors(batch, i):
            check = getattr(p, "valid_prefix", None)
            if check is None:
                continue
            if context is None:
                before = batch._token_context[i].tokens
                context = mx.concatenate([before, inputs[i : i + 1].astype(before.dtype)])
            keep = min(keep, check(context, guess[:keep]))
            if keep == 0:
                break
        if keep == 0:
            # nothing proposed after all: the draft's cache drops its guesses
            self.proposer.accepted(batch.uids[i], len(batch.tokens[i]) + 1, 0, 0)
        return guess[:keep]

    def _verify(self, batch: EngineGenerationBatch, inputs: mx.array, current: list[int],
                proposals: list[list[int]], width: int) -> list[Any] | None:
        rows = [[current[i], *p, *([current[i]] * (width - len(p)))] for i, p in enumerate(proposals)]
        batch._current_tokens = inputs  # type: ignore[assignment]  # mlx-lm's __init__ types it None
        current_logprobs = batch._next_logprobs
        adapters = batch.adapters
        if adapters is not None:  # a row's adapter applies to all of its positions
            adapters.select_rows(batch.uids)
        try:
            logits = batch.model(mx.array(rows, dtype=mx.uint32), cache=batch.prompt_cache)
        finally:
            if adapters is not None:
                adapters.clear()
        if logits.ndim != 3 or logits.shape[1] != width + 1:
            # the model returns its last position's logits only: it cannot verify
            for c in batch.prompt_cache:
                c.trim(width + 1)
            log.warning("speculative decoding is off: the model does not return every position's logits")
            self.max_batch = 0
            return None
        # position 0 of every row through its processors (their contexts take the current token)
        first, token_context = process_rows(batch, logits[:, 0, :], inputs)
        logprobs = first - mx.logsumexp(first, axis=-1, keepdims=True)
        plain = [i for i, p in enumerate(proposals) if not p]
        sampled = batch.sample_rows(logprobs[mx.array(plain)], plain) if plain else None
        draws = {i: self._draw(batch, i, logits, first, p) for i, p in enumerate(proposals) if p}
        wanted = batch.logprob_uids
        next_logprobs = [logprobs[i] if uid in wanted else None for i, uid in enumerate(batch.uids)]
        # the rows reading log-probabilities get them at every position they may emit
        read = {i: draws[i][0] - mx.logsumexp(draws[i][0], axis=-1, keepdims=True)
                for i in draws if batch.uids[i] in wanted}
        mx.eval(sampled, [d[1:] for d in draws.values()], read, token_context, next_logprobs, current_logprobs)
        plain_ids: list[int] = sampled.tolist() if sampled is not None else []  # type: ignore[assignment]
        plain_next = dict(zip(plain, plain_ids, strict=True))

        emitted: list[list[int]] = []
        later: list[list[Any]] = [[] for _ in proposals]
        nexts: list[int] = []
        surplus: list[int] = []
        for i, guess in enumerate(proposals):
            if not guess:
                emitted.append([current[i]])
                nexts.append(plain_next[i])
                surplus.append(width)
                continue
            _, tokens, accept = draws[i]
            target: list[int] = tokens.tolist()  # type: ignore[assignment]
            a = 0
            if accept is None:  # greedy: the guess is right where it is the target's argmax
                while a < len(guess) and guess[a] == target[a]:
                    a += 1
            else:
                ok: list[bool] = accept.tolist()  # type: ignore[assignment]
                while a < len(guess) and ok[a]:
                    a += 1
            emitted.append([current[i], *guess[:a]])
            if i in read:
                later[i] = [read[i][j] for j in range(a)]
                next_logprobs[i] = read[i][a]
            nexts.append(target[a])
            surplus.append(width - a)
            self._accepted(batch, i, guess, a)
        self.steps += 1
        self._last = (len(proposals), True)
        _drop_surplus(batch.prompt_cache, surplus)
        for seq, toks in zip(batch.tokens, emitted, strict=True):
            seq.extend(toks)
        batch._next_tokens = mx.array(nexts, dtype=mx.uint32)
        batch._next_logprobs = next_logprobs
        batch._current_logprobs = current_logprobs
        return batch.respond(emitted, current_logprobs, later)

    def _draw(self, batch: EngineGenerationBatch, i: int, logits: mx.array, first: mx.array,
              guess: list[int]) -> tuple[mx.array, mx.array, mx.array | None]:
        """Row ``i``'s verify outcome, lazily: its processed logits at each
        position 0..G (log-probabilities are read from them), the token to emit at each
        position 0..G if the guesses before it are accepted (and the guess
        there rejected), and for a sampled row whether each guess is accepted.

        Greedy: the target's argmax at each position.  Sampled (the proposal
        is one token, a point mass): guess ``x_j`` is accepted with probability
        ``p_j(x_j)``, ``p_j`` the row's sampling distribution there (its
        processors, filters and temperature applied); on rejection the token
        is drawn from ``p_j`` without ``x_j``, renormalized; after ``G``
        accepted guesses from ``p_G``.  Each emitted token is then distributed
        exactly as the row's sampler would draw it, one token at a time."""
        g = len(guess)
        scores = _processed(batch, i, logits, first, guess)
        lp = scores - mx.logsumexp(scores, axis=-1, keepdims=True)
        sampler = _sampler(batch, i)
        if sampler is greedy_sampler:
            return scores, mx.argmax(lp, axis=-1), None
        weights = sampler.distribution(lp.astype(mx.float32))
        log_p = weights - mx.logsumexp(weights, axis=-1, keepdims=True)
        ids = mx.array(guess, dtype=mx.uint32)[:, None]
        p_guess = mx.exp(mx.take_along_axis(log_p[:g], ids, axis=-1))[:, 0]
        hit = mx.arange(weights.shape[-1], dtype=mx.uint32)[None, :] == ids
        rest = mx.where(hit, -mx.inf, weights[:g])
        key_accept, key_token = sampler.keys()
        u = mx.random.uniform(shape=(g,), key=key_accept)
        # p_j(x_j) == 1 leaves nothing to draw from on rejection: always accepted
        accept = (u < p_guess) | mx.all(rest == -mx.inf, axis=-1)
        tokens = mx.random.categorical(mx.concatenate([rest, weights[g:]], axis=0), key=key_token)
        return scores, tokens, accept

    def _accepted(self, batch: EngineGenerationBatch, i: int, guess: list[int], a: int) -> None:
        """Bookkeeping after row ``i`` accepted ``a`` of its ``guess``: counters,
        the proposer, and its processors' state (their contexts take the
        accepted tokens; a stateful one forgets the rest)."""
        uid = batch.uids[i]
        self._rest(uid, a, self.needed(len(batch.uids)))
        self.proposer.accepted(uid, len(batch.tokens[i]) + 1, len(guess), a)
        counts = self.by_uid.setdefault(uid, [0, 0])
        counts[0] += len(guess)
        counts[1] += a
        self.proposed += len(guess)
        self.accepted += a
        procs = _processors(batch, i)
        if procs:
            for p in procs:
                undo = getattr(p, "rollback", None)
                if undo is not None:
                    undo(len(guess) - a)
            if a:
                batch._token_context[i].update_and_fetch(mx.array(guess[:a], dtype=mx.int32))


def _speculates(sampler: Any) -> bool:
    """Whether a row drawing with ``sampler`` can speculate: it is greedy, or
    it exposes its distribution (``afm_core._engine.sampling.FilteredSampler``)."""
    return sampler is greedy_sampler or (callable(getattr(sampler, "distribution", None))
                                         and callable(getattr(sampler, "keys", None)))


def _sampler(batch: EngineGenerationBatch, i: int) -> Any:
    """Row ``i``'s sampler (the batch's fallback where it has none of its own)."""
    s = batch.samplers[i] if batch.samplers else None
    return batch.fallback_sampler if s is None else s


def _processors(batch: EngineGenerationBatch, i: int) -> Sequence[Any]:
    """Row ``i``'s logits processors (none: empty)."""
    return (batch.logits_processors[i] if batch.logits_processors else None) or ()


def _processed(batch: EngineGenerationBatch, i: int, logits: mx.array, first: mx.array,
               guess: list[int]) -> mx.array:
    """Row ``i``'s logits at positions 0..len(guess), each through the row's
    processors fed the tokens before it (``first``: position 0, done)."""
    g = len(guess)
    procs = _processors(batch, i)
    if not procs:
        return mx.concatenate([first[i : i + 1], logits[i, 1 : g + 1]], axis=0)
    before = batch._token_context[i].tokens  # through the current token
    rows = [first[i : i + 1]]
    for j in range(1, g + 1):
        context = mx.concatenate([before, mx.array(guess[:j], dtype=before.dtype)])
        row = logits[i, j : j + 1]
        for p in procs:
            row = p(context, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def _drop_surplus(cache: list[Any], surplus: list[int]) -> None:
    """Take ``surplus[i]`` trailing positions off row ``i`` of every layer."""
    common = min(surplus)
    rest = [s - common for s in surplus]
    for c in cache:
        if common:
            c.trim(common)
        if any(rest):
            c.prepare(right_padding=rest)
            c.finalize()
