"""The engine's decode batch gives exactly mlx-lm's tokens and log-probabilities."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_logits_processors

from afm_core._engine.sampling import SamplerCache
from afm_core._mlx.batch import EngineGenerationBatch, install
from afm_core.api.chat_request import ChatRequest


def sampler_for(cache: SamplerCache, **kw: Any) -> Any:
    req = ChatRequest.from_openai({"messages": [{"role": "user", "content": "x"}], **kw})
    return cache.get(req, 1 << 30)


def run(model: Any, prompts: list[list[int]], params: list[dict[str, Any]], *, engine_batch: bool,
        logprob_rows: set[int]) -> dict[int, tuple[list[int], list[Any]]]:
    cache = SamplerCache()
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=len(prompts), prefill_batch_size=4)
    wanted: set[int] = set()
    if engine_batch:
        install(gen, wanted)
    samplers = [sampler_for(cache, **p) for p in params]
    procs = [make_logits_processors(repetition_penalty=1.3) if i % 3 == 0 else [] for i in range(len(prompts))]
    uids = gen.insert(prompts, max_tokens=[12] * len(prompts), samplers=samplers, logits_processors=procs)
    wanted.update(uids[i] for i in logprob_rows)
    out: dict[int, tuple[list[int], list[Any]]] = {i: ([], []) for i in range(len(prompts))}
    row = {u: i for i, u in enumerate(uids)}
    while responses := gen.next_generated():
        for r in responses:
            toks, lps = out[row[r.uid]]
            toks.append(r.token)
            lps.append(r.logprobs)
    if engine_batch:
        assert isinstance(gen._generation_batch, EngineGenerationBatch)
    gen.close()
    return out


@pytest.fixture(scope="module")
def model(random_model_dir: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(random_model_dir))[0]


def test_same_tokens_and_logprobs_as_mlx_lm(model: Any) -> None:
    prompts = [[1 + (7 * i + j) % 900 for j in range(5 + i)] for i in range(9)]
    # greedy rows, two shared temperature groups and seeded rows, in one batch
    params = [{"temperature": 0}, {"temperature": 0.7, "seed": 1}, {"temperature": 0.7, "seed": 2},
              {"temperature": 0}, {"temperature": 1.0, "seed": 3, "top_p": 0.9},
              {"temperature": 0}, {"temperature": 0.5, "seed": 4, "top_k": 20}, {"temperature": 0},
              {"temperature": 1.2, "seed": 5, "min_p": 0.05}]
    logprob_rows = {0, 4, 8}
    ours = run(model, prompts, params, engine_batch=True, logprob_rows=logprob_rows)
    theirs = run(model, prompts, params, engine_batch=False, logprob_rows=logprob_rows)
    for i in range(len(prompts)):
        assert ours[i][0] == theirs[i][0], i
        assert len(ours[i][0]) == 12
        for k, (a, b) in enumerate(zip(ours[i][1], theirs[i][1], strict=True)):
            if i in logprob_rows or k == 0:  # the first token comes from mlx-lm's own prefill batch
                assert a is not None and mx.allclose(a, b).item()
            else:
                assert a is None


def test_shared_unseeded_samplers_are_sampled_together(model: Any) -> None:
    calls: list[int] = []

    def counting(logprobs: mx.array) -> mx.array:
        calls.append(logprobs.shape[0])
        return mx.argmax(logprobs, axis=-1)

    def other(logprobs: mx.array) -> mx.array:
        calls.append(-logprobs.shape[0])
        return mx.argmax(logprobs, axis=-1)

    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=6, prefill_batch_size=6)
    install(gen, set())
    prompts = [[5, 6, 7 + i] for i in range(6)]
    gen.insert(prompts, max_tokens=[4] * 6, samplers=[counting, other] * 3)
    tokens = 0
    while responses := gen.next_generated():
        tokens += len(responses)
    gen.close()
    assert tokens == 24
    # mlx-lm's prefill batch samples the first token row by row; every decode
    # step after that makes one call of 3 rows per sampler
    assert calls[:6] == [1, -1] * 3
    rest = calls[6:]
    assert len(rest) >= 6 and rest == [3, -3] * (len(rest) // 2)


def test_install_refuses_a_busy_generator(model: Any) -> None:
    gen = BatchGenerator(model, stop_tokens=[])
    gen.insert([[1, 2, 3]], max_tokens=[2])
    with pytest.raises(RuntimeError):
        install(gen, set())
    gen.close()


def test_the_layers_share_one_offset_array(model: Any) -> None:
    """After a step every plain KV layer reads the first layer's offsets (the
    others' additions are never evaluated); they are each layer's own numbers."""
    from afm_core._mlx import half_cache

    for half in (False, True):
        gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=4, prefill_batch_size=4)
        install(gen, set())
        gen.insert([[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]], max_tokens=[6, 6])
        steps = 0
        while gen.next_generated():
            caches = gen._generation_batch.prompt_cache
            if half and steps == 0:
                half_cache.to_half(caches)
            steps += 1
            if steps < 2 or len(gen._generation_batch.uids) < 2:
                continue  # (rows leaving the batch filter every layer's offsets apart)
            assert len({id(c.offset) for c in caches}) == 1
            for c in caches:
                assert (c.offset == c._idx - c.left_padding).all().item()
        assert steps == 6
        gen.close()
