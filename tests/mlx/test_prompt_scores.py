"""Prompt scoring in the engine's prefill (``PromptScores``): scored rows get
their prompt's log-probabilities as one forward pass gives them, at any
chunking, and the rows prefilled beside them generate exactly mlx-lm's tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from afm_core._mlx.batch import occupancy
from afm_core._mlx.prefill import SCORE_SPAN, EngineBatchGenerator, PromptScores


@pytest.fixture(scope="module")
def model(random_model_dir: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(random_model_dir))[0]


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 40, SCORE_SPAN + 30, 70, 3]
    return [[rng.randrange(3, 1000) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def reference(model: Any, prompt: list[int], k: int) -> tuple[list[float], list[list[float]]]:
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = [lp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    tops = [sorted(lp[i].tolist(), reverse=True)[:k] for i in range(len(prompt) - 1)]
    return chosen, tops


def generate(gen: Any, batch: list[list[int]], scored: set[int], k: int) -> tuple[dict[int, list[int]], dict[int, PromptScores]]:
    tokens: dict[int, list[int]] = {}
    scores: dict[int, PromptScores] = {}
    row: dict[int, int] = {}
    for i, p in enumerate(batch):
        if isinstance(gen, EngineBatchGenerator):
            s = PromptScores(p, k) if i in scored else None
            uid = gen.insert_one(p, max_tokens=6, cache=None, all_tokens=[], sampler=None,
                                 logits_processors=[], stop_at_eos=False, scores=s)
            if s is not None:
                scores[i] = s
        else:
            (uid,) = gen.insert([p], max_tokens=[6])
        row[uid] = i
        tokens[i] = []
    while not occupancy(gen).empty:
        for r in gen.next()[1]:
            tokens[row[r.uid]].append(r.token)
    gen.close()
    return tokens, scores


@pytest.mark.parametrize("step", [2048, 32])
def test_scored_rows_match_a_forward_pass_and_the_others_mlx_lm(model: Any, step: int) -> None:
    batch = prompts(9, seed=step)
    kw: dict[str, Any] = {"stop_tokens": [], "completion_batch_size": 5, "prefill_batch_size": 3,
                          "prefill_step_size": step}
    scored = {0, 1, 3, 4, 8}
    ours, scores = generate(EngineBatchGenerator(model, logprob_uids=set(), **kw), batch, scored, 3)
    theirs, _ = generate(BatchGenerator(model, **kw), batch, set(), 3)
    assert ours == theirs  # scoring changes nobody's tokens, its own or its neighbours'
    for i in scored:
        s = scores[i]
        want, tops = reference(model, batch[i], 3)
        assert s.error is None and len(s.logprobs) == len(batch[i]) - 1 == len(s.top_ids)
        assert all(abs(a - b) < 1e-4 for a, b in zip(s.logprobs, want, strict=True))
        for ids, vals, ref in zip(s.top_ids, s.top_logprobs, tops, strict=True):
            assert len(ids) == 3 and vals == sorted(vals, reverse=True)
            assert all(abs(a - b) < 1e-4 for a, b in zip(vals, ref, strict=True))


def test_scores_without_alternatives_and_their_lifetime(model: Any) -> None:
    gen = EngineBatchGenerator(model, logprob_uids=set(), stop_tokens=[])
    s = PromptScores([5, 6, 7, 8], 0)
    uid = gen.insert_one([5, 6, 7, 8], max_tokens=2, cache=None, all_tokens=[], sampler=None,
                         logits_processors=[], scores=s)
    other = gen.insert_one([9, 10], max_tokens=2, cache=None, all_tokens=[], sampler=None,
                           logits_processors=[], scores=PromptScores([9, 10], 1))
    assert set(gen.prompt_scores) == {uid, other}
    gen.remove([other])  # removed before its prefill: its scores go with it
    assert set(gen.prompt_scores) == {uid}
    while not occupancy(gen).empty:
        gen.next()
    assert len(s.logprobs) == 3 and s.top_ids == [] and s.top_logprobs == []
    gen.forget_scores(uid)
    assert gen.prompt_scores == {}
    gen.close()


def test_a_model_returning_only_the_last_position_cannot_score(model: Any) -> None:
    class LastOnly:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def __call__(self, inputs: mx.array, cache: Any = None, **kw: Any) -> Any:
            return self.inner(inputs, cache=cache, **kw)[:, -1:, :]

    gen = EngineBatchGenerator(LastOnly(model), logprob_uids=set(), stop_tokens=[])
    s = PromptScores([5, 6, 7, 8, 9], 2)
    gen.insert_one([5, 6, 7, 8, 9], max_tokens=3, cache=None, all_tokens=[], sampler=None,
                   logits_processors=[], scores=s)
    out = []
    while not occupancy(gen).empty:
        out += [r.token for r in gen.next()[1]]
    assert s.error is not None and "every prompt position" in s.error and s.logprobs == []
    assert len(out) == 3  # generation itself is unaffected
    gen.close()
