"""Speculative sampling draws from the row's own distribution.

The decode batch with a :class:`Speculation` (the target model as its own
draft, so its greedy guesses are often but not always accepted) samples the
first three tokens of many seeded rows; their empirical joint distribution is
compared with the exact one, computed from the model's logits through the
same filters (``FilteredSampler.distribution``), by a chi-square statistic
against its 1 - 3e-7 quantile.  Seeds are fixed, so the test is
deterministic.  Checked by hand when it was written (first parameters, 600
samples): the right rule gave 15.9 against a bound of 64.4 (17 degrees of
freedom), a rule accepting every guess 732.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from afm_core._engine.sampling import FilteredSampler
from afm_core._mlx.batch import install
from afm_core._mlx.speculative import DraftModel, Speculation

ROWS = 8
"""Rows per batch: 31 verify rows / 8 leaves 2 guesses per row."""
SAMPLES = 1200
N_TOKENS = 3


@pytest.fixture(scope="module")
def model(random_model_dir: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(random_model_dir))[0]


def prompt() -> list[int]:
    rng = random.Random(3)
    return [rng.randrange(3, 1000) for _ in range(10)]


def exact(model: Any, params: dict[str, Any], ids: list[int], depth: int) -> dict[tuple[int, ...], float]:
    """The exact joint distribution of the next ``depth`` tokens (cells above 1e-9)."""
    sampler = FilteredSampler(**params)
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == depth:
            out[prefix] = mass
            return
        logits = model(mx.array([ids + list(prefix)]))[0, -1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits)
        w = sampler.distribution(lp[None])[0]
        p = mx.softmax(w)
        probs: list[float] = p.tolist()  # type: ignore[assignment]
        for t, q in enumerate(probs):
            if q * mass > 1e-9:
                walk((*prefix, t), mass * q)

    walk((), 1.0)
    return out


def sample(model: Any, params: dict[str, Any], ids: list[int], n: int) -> tuple[list[tuple[int, ...]], Speculation]:
    spec = Speculation(DraftModel(model), tokens=2, max_batch=ROWS)
    got: list[tuple[int, ...]] = []
    for start in range(0, n, ROWS):
        gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=ROWS, prefill_batch_size=ROWS)
        install(gen, set(), speculation=spec)
        samplers = [FilteredSampler(**params, seed=1000 + start + i) for i in range(ROWS)]
        uids = gen.insert([ids] * ROWS, max_tokens=[N_TOKENS] * ROWS, samplers=samplers,
                          logits_processors=[[] for _ in range(ROWS)])
        rows: dict[int, list[int]] = {u: [] for u in uids}
        while responses := gen.next_generated():
            for r in responses:
                rows[r.uid].append(r.token)
        gen.close()
        got.extend(tuple(rows[u]) for u in uids)
    return got, spec


def chi_square(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float], n: int) -> tuple[float, int]:
    """The statistic and its degrees of freedom, cells expected fewer than 5
    times pooled into one (with every outcome the exact distribution misses)."""
    stat, df = 0.0, -1
    pooled_expected, pooled_seen = 0.0, 0
    for cell, p in probs.items():
        e = p * n
        if e < 5:
            pooled_expected += e
            pooled_seen += counts.get(cell, 0)
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        df += 1
    pooled_seen += sum(c for cell, c in counts.items() if cell not in probs)
    pooled_expected = max(pooled_expected, 1e-9 * n)
    stat += (pooled_seen - pooled_expected) ** 2 / max(pooled_expected, 1.0)
    return stat, df + 1


def quantile(df: int, z: float = 5.0) -> float:
    """Wilson-Hilferty: the chi-square quantile at the normal's ``z`` (5: 3e-7 above it)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("params", [
    {"temp": 1.0, "top_k": 3},
    {"temp": 0.8, "top_p": 0.95, "min_p": 0.2, "top_k": 4},
])
def test_speculative_sampling_has_the_target_distribution(model: Any, params: dict[str, Any]) -> None:
    ids = prompt()
    probs = exact(model, params, ids, N_TOKENS)
    got, spec = sample(model, params, ids, SAMPLES)
    # both outcomes of a guess happened many times: the test sees acceptance and rejection
    assert spec.steps > 0 and 0.1 * spec.proposed < spec.accepted < 0.9 * spec.proposed, \
        (spec.proposed, spec.accepted)
    counts: dict[tuple[int, ...], int] = {}
    for seq in got:
        assert len(seq) == N_TOKENS
        counts[seq] = counts.get(seq, 0) + 1
    stat, df = chi_square(counts, probs, len(got))
    assert df >= 3
    assert stat < quantile(df), (stat, df, quantile(df))


def test_seeded_rows_repeat(model: Any) -> None:
    """The same seeds give the same tokens again (speculating)."""
    ids = prompt()
    params = {"temp": 1.0, "top_k": 3}
    assert sample(model, params, ids, ROWS)[0] == sample(model, params, ids, ROWS)[0]
