"""The engine's memory defaults: a float16 KV cache where the model computes
in float32 and its keys and values fit (``kv_dtype="auto"``), a prefix
cache sized to the model (the KV cache of one request filling its context),
MLX's cache of freed buffers sized to the model and emptied whenever the
engine falls idle."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from afm_core import CompletionRequest, Usage, open_engine
from afm_core._engine.engine import Engine
from afm_core._engine.kv_memory import buffer_cache_bytes
from afm_core._mlx.half_cache import KVCache
from tests.engine.test_engine import settled


def raw(ids: list[int], **kw: object) -> CompletionRequest:
    return CompletionRequest.from_openai({"temperature": 0, "ignore_eos": True, **kw}, tuple(ids))


async def drain(engine: Engine, request: CompletionRequest) -> None:
    async with engine.stream(request) as s:
        events = [e async for e in s]
    assert isinstance(events[-1], Usage)


def kv_bytes_per_token(model_dir: Path, element: int) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head * element


async def test_float16_kv_and_a_prefix_cache_sized_to_the_model(random_model_dir: Path) -> None:
    context = json.loads((random_model_dir / "config.json").read_text())["max_position_embeddings"]
    async with open_engine(random_model_dir, warmup=False) as engine:
        s = engine.statistics()
        assert s.kv_cache == "float16"
        assert s.prefix_cache_budget == kv_bytes_per_token(random_model_dir, 2) * context
        ids = list(range(3, 200))
        await drain(engine, raw(ids, max_tokens=4))
        worker = engine._worker
        assert worker is not None
        # the finished request's cache, as the prefix cache keeps it (a copy)
        cache, rest = worker.prefix_cache.fetch_nearest_cache(worker.model_key, ids)
        assert cache is not None and len(rest) <= 1
        assert all(type(c) is KVCache and c.keys.dtype == mx.float16 for c in cache)


async def test_the_model_s_type_and_an_explicit_budget(random_model_dir: Path) -> None:
    async with open_engine(random_model_dir, warmup=False, kv_dtype="model",
                           prefix_cache_bytes=123 << 20) as engine:
        s = engine.statistics()
        assert s.kv_cache == "the model's type" and s.prefix_cache_budget == 123 << 20
        await drain(engine, raw(list(range(3, 50)), max_tokens=2))


async def test_falling_idle_gives_mlx_s_freed_buffers_back(random_model_dir: Path) -> None:
    async with open_engine(random_model_dir, warmup=False, prefix_cache_bytes=0) as engine:
        freed = mx.ones((1 << 20,))  # a buffer freed into MLX's (process-wide) cache
        mx.eval(freed)
        del freed
        assert mx.get_cache_memory() >= 4 << 20
        await drain(engine, raw(list(range(3, 300)), max_tokens=40))
        await settled(engine)
        assert mx.get_cache_memory() == 0


def test_the_buffer_cache_is_an_eighth_of_the_weights_within_mlx_s_default() -> None:
    mib = 1 << 20
    assert buffer_cache_bytes(97 * mib, {}) == 97 * mib // 8  # the default model: 12 MiB
    assert buffer_cache_bytes(1 * mib, {}) == 8 * mib
    assert buffer_cache_bytes(528 * mib, {}) == 32 * mib  # MLX's own default
    assert buffer_cache_bytes(97 * mib, {"AFM_MLX_CACHE_MIB": "0"}) == 0
    assert buffer_cache_bytes(97 * mib, {"AFM_MLX_CACHE_MIB": "40"}) == 40 * mib


async def test_an_engine_sizes_mlx_s_buffer_cache_to_its_model(random_model_dir: Path, monkeypatch) -> None:
    before = mx.set_cache_limit(32 << 20)
    try:
        async with open_engine(random_model_dir, warmup=False):
            assert mx.set_cache_limit(32 << 20) == 8 << 20  # (a tiny model: the floor)
        monkeypatch.setenv("AFM_MLX_CACHE_MIB", "20")
        async with open_engine(random_model_dir, warmup=False):
            assert mx.set_cache_limit(32 << 20) == 20 << 20
    finally:
        mx.set_cache_limit(before)
