"""A quantized KV cache (``EngineConfig.kv_bits``) through the whole engine,
on a random tiny model whose head size (64) the default group size divides:
batches of concurrent greedy streams agree with float KV (8 bits: nearly
always; 4 bits: at the start) and with themselves run one at a time; cancel,
the grammar and the profile work; the prefix cache serves quantized entries
from memory and from disk after a restart, and never serves an entry of
another ``kv_bits`` setting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from afm_core import EngineConfig, Finish, LogprobsDelta, open_engine
from afm_core._engine.config import DistributedConfig
from afm_core._engine.engine import Engine
from afm_core._errors import ModelLoadError
from afm_core.testing import make_random_model
from tests.engine.test_disk_cache import files, prompt_ids, raw, run, written
from tests.engine.test_engine import req, settled, wait_for

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

N_TOKENS = 16
PROMPTS = [prompt_ids(n, seed) for seed, n in enumerate((40, 90, 17, 150, 60, 33))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(tmp_path_factory.mktemp("kv"), hidden_size=256, num_heads=4, num_kv_heads=2)


async def greedy(engine: Engine, ids: list[int]) -> list[tuple[str, float]]:
    """One greedy request's tokens, each with its log-probability."""
    async with engine.stream(raw(ids, max_tokens=N_TOKENS)) as s:
        return [(t.token, t.logprob) async for e in s if isinstance(e, LogprobsDelta) for t in e.content]


async def greedy_batch(engine: Engine, prompts: list[list[int]]) -> list[list[tuple[str, float]]]:
    """Each prompt's greedy tokens and log-probabilities, all requests in flight together."""
    out: list[list[tuple[str, float]]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        out[i] = await greedy(engine, prompts[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out


def leading_agreement(a: list[list[tuple[str, float]]],
                      b: list[list[tuple[str, float]]]) -> tuple[float, float]:
    """The fraction of tokens identical before each pair's first divergence,
    and the largest difference of their log-probabilities there."""
    same = 0
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for (s, p), (t, q) in zip(x, y, strict=True):
            if s != t:
                break
            same += 1
            worst = max(worst, abs(p - q))
    return same / sum(len(x) for x in a), worst


async def test_greedy_batches_against_float_kv(model_dir: Path) -> None:
    kw: dict[str, Any] = {"prefix_cache_bytes": 0, "warmup": False}
    async with open_engine(model_dir, **kw) as engine:
        ref = await greedy_batch(engine, PROMPTS)
    results = {}
    for bits in (8, 4):
        async with open_engine(model_dir, kv_bits=bits, **kw) as engine:
            s = engine.statistics()
            assert (s.kv_bits, s.kv_group_size) == (bits, 64)
            batched = await greedy_batch(engine, PROMPTS)
            alone = [await greedy(engine, p) for p in PROMPTS[:3]]
        assert all(len(t) == N_TOKENS for t in batched)
        results[bits] = leading_agreement(batched, ref)
        # A row's output does not depend on the rows decoding beside it, up to float
        # rounding.  Which rows share a step (and a prefill) depends on when the requests
        # arrive, and quantizing a key or value can turn a last-bit difference into one
        # quantization step (4 bits: 5e-3 in a log-probability, on any CPU), so the
        # bound is what the quantization itself moves a log-probability in this same
        # run (its worst difference from float KV), and never less than 1e-3.
        same, worst = leading_agreement(alone, batched[:3])
        assert same == 1.0 and worst <= max(1e-3, results[bits][1]), (bits, worst, results[bits])
        # the first token comes from prefill attention over the quantized prompt: same argmax
        assert [t[0][0] for t in batched] == [t[0][0] for t in ref]
    # On this model another context moves a log-probability by several units,
    # 8-bit KV by a few hundredths (4 bits: a few tenths): a broken cache
    # (another row's keys, stale positions, lost padding) fails these bounds.
    assert results[8][0] >= 0.9 and results[8][1] < 0.1, results
    assert results[4][0] >= 0.3 and results[4][1] < 1.0, results


async def test_cancel_grammar_and_profile(model_dir: Path) -> None:
    async with open_engine(model_dir, kv_bits=8, max_batch=4) as engine:
        got: list[Any] = []
        others: list[list[str]] = [[], []]

        async def victim() -> None:
            async with engine.stream(raw(PROMPTS[0], max_tokens=3000), request_id="victim") as s:
                async for e in s:
                    got.append(e)

        async def bystander(i: int) -> None:
            others[i] = (await run(engine, PROMPTS[i + 1], max_tokens=N_TOKENS))[0]

        async with trio.open_nursery() as n:
            n.start_soon(victim)
            n.start_soon(bystander, 0)
            n.start_soon(bystander, 1)
            await wait_for(lambda: sum(isinstance(e, LogprobsDelta) for e in got) >= 5, 30)
            assert engine.cancel("victim") is True
        assert Finish("cancelled") in got
        assert all(len(o) == N_TOKENS for o in others)
        stats = await settled(engine)
        assert stats.running == 0 and stats.requests_active == 0

        # strict JSON schema under the grammar: valid output from the quantized cache
        schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                  "required": ["city"], "additionalProperties": False}
        r = req("where?", max_tokens=40, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
        c = await engine.complete(r)
        assert json.loads(c["choices"][0]["message"]["content"])["city"] in ("Paris", "Oslo")

        _, _, profile = await run(engine, PROMPTS[2])
        assert profile["kv_bits"] == 8
    async with open_engine(model_dir, warmup=False) as engine:
        _, _, profile = await run(engine, PROMPTS[2])
        assert profile["kv_bits"] is None


async def test_prefix_cache_memory_and_disk_with_quantized_entries(model_dir: Path, tmp_path: Path) -> None:
    prompt = prompt_ids(300, 7)
    async with open_engine(model_dir, kv_bits=8, prefix_cache_bytes=0, warmup=False) as cold:
        expected, _, _ = await run(cold, prompt)
    async with open_engine(model_dir, kv_bits=8, cache_dir=tmp_path) as first:
        toks, usage, _ = await run(first, prompt)
        assert toks == expected and usage.cached_tokens == 0
        toks, usage, profile = await run(first, prompt)  # from the memory tier
        assert toks == expected and usage.cached_tokens == len(prompt) - 1
        assert profile["prefix_tier"] == "memory"
        assert (await settled(first)).prefix_cache_bytes > 0
        await written(first, 1)
    (entry,) = files(tmp_path)
    async with open_engine(model_dir, kv_bits=8, cache_dir=tmp_path) as second:  # a restart
        assert second.statistics().prefix_cache_disk_entries == 1
        toks, usage, profile = await run(second, prompt)
        assert toks == expected and profile["prefix_tier"] == "disk"
        assert usage.cached_tokens == len(prompt) - 1
    # another setting never reads that entry: to it, the file is another model's
    for other in ({"kv_bits": 4}, {}):
        async with open_engine(model_dir, cache_dir=tmp_path, warmup=False, **other) as third:
            s = third.statistics()
            assert (s.prefix_cache_disk_entries, s.prefix_cache_disk_bytes) == (0, 0)
            _, usage, profile = await run(third, prompt)
            assert usage.cached_tokens == 0 and profile["prefix_tier"] is None
            s = await settled(third)
            assert (s.prefix_cache_disk_hits, s.prefix_cache_disk_corrupt) == (0, 0)
        assert entry.exists()  # left alone


def test_config_refuses_what_does_not_work() -> None:
    with pytest.raises(ValueError, match="kv_bits must be 4, 8"):
        EngineConfig(kv_bits=3)
    with pytest.raises(ValueError, match="kv_group_size"):
        EngineConfig(kv_bits=8, kv_group_size=48)
    with pytest.raises(ValueError, match="distributed"):
        EngineConfig(kv_bits=8, distributed=DistributedConfig())


async def test_a_model_whose_heads_the_group_size_does_not_divide(random_model_dir: Path) -> None:
    from afm_core._mlx import attention

    users = dict(attention._REBINDING.users)
    with pytest.raises(BaseExceptionGroup) as info:
        async with open_engine(random_model_dir, kv_bits=8):
            pass
    # the start failed after the CPU rewrite: it was undone (the decode
    # attention's module-wide name is no longer counted for this model)
    assert attention._REBINDING.users == users
    err = info.value
    while isinstance(err, BaseExceptionGroup):
        err = err.exceptions[0]
    assert isinstance(err, ModelLoadError) and "head size 16 is not a multiple of kv_group_size 64" in str(err)
