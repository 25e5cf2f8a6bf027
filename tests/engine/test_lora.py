"""LoRA adapters per request (EngineConfig.adapters) on the random tiny model:
adapters trained offline with mlx-lm's tuner, outputs equal to mlx-lm's own
``load_adapters`` model, rows on different adapters in one batch equal to each
alone, cancel, and a prefix cache that never serves one adapter's KV to another."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import trio

from afm_core import AdapterNotFoundError, CompletionRequest, Finish, ModelLoadError, open_engine
from afm_core._engine.engine import Engine
from afm_core.testing import make_lora_adapter
from tests.engine.test_completions import mlx_lm_greedy, raw, run, text
from tests.engine.test_engine import collect, req, settled

ALL_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def adapters(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        # q/v at rank 8 (mlx-lm's defaults but the keys), trained a few steps
        "fox": make_lora_adapter(random_model_dir, root / "fox"),
        # every projection at rank 4, other text
        "zebra": make_lora_adapter(random_model_dir, root / "zebra", keys=ALL_PROJECTIONS, rank=4, seed=1,
                                   texts=("Zebra yak zebra yak. " * 10, "ok ok ok ok ok ok ok ok " * 5)),
    }


def served(adapters: dict[str, Path]) -> tuple[tuple[str, str], ...]:
    return tuple((name, str(path)) for name, path in adapters.items())


def mlx_reference(model_dir: Path, adapter: Path | None, ids: list[int], n: int) -> list[int]:
    import mlx_lm
    from mlx_lm.tuner.utils import load_adapters

    model = mlx_lm.load(str(model_dir))[0]
    if adapter is not None:
        load_adapters(model, str(adapter))
    return mlx_lm_greedy(model, ids, n, [])


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 23)]


async def tokens(engine: Engine, ids: list[int], n: int = 16, **kw: Any) -> tuple[list[int], Any]:
    """Greedy ids of one completion (through the detokenizer: compared as text) and its usage."""
    events, _ = await run(engine, raw(ids, max_tokens=n, temperature=0, ignore_eos=True, **kw))
    assert events[-2] == Finish("length")
    return text(events), events[-1]


async def test_adapter_outputs_equal_mlx_lm_load_adapters(random_model_dir: Path, adapters: dict[str, Path]) -> None:
    import mlx_lm

    tok = mlx_lm.load(str(random_model_dir))[1]
    async with open_engine(random_model_dir, cpu_fusion=False, prefix_cache_bytes=0,
                           adapters=served(adapters)) as engine:
        assert engine.adapters == ("fox", "zebra")
        for ids in prompts():
            base = tok.decode(mlx_reference(random_model_dir, None, ids, 16))
            outs = {None: base}
            assert (await tokens(engine, ids))[0] == base
            for name, path in adapters.items():
                want = tok.decode(mlx_reference(random_model_dir, path, ids, 16))
                assert (await tokens(engine, ids, adapters=name))[0] == want, name
                outs[name] = want
            assert len(set(outs.values())) == 3  # each adapter measurably changes the output


@pytest.mark.parametrize("fusion", [True, False])
async def test_rows_on_different_adapters_batch_together(random_model_dir: Path, adapters: dict[str, Path],
                                                         fusion: bool) -> None:
    async with open_engine(random_model_dir, cpu_fusion=fusion, prefix_cache_bytes=0,
                           adapters=served(adapters)) as engine:
        ids = prompts()[1]
        alone = {name: (await tokens(engine, ids, 24, adapters=name))[0] for name in ("fox", "zebra")}
        alone[None] = (await tokens(engine, ids, 24))[0]
        assert len(set(alone.values())) == 3
        steps = (await settled(engine)).steps
        got: dict[int, str] = {}
        order = [None, "fox", "zebra", "fox", None, "zebra"]

        async def one(i: int, name: str | None) -> None:
            kw = {} if name is None else {"adapters": name} if i % 2 else {"model": f"tiny:{name}"}
            got[i] = (await tokens(engine, ids, 24, **kw))[0]

        async with trio.open_nursery() as nursery:
            for i, name in enumerate(order):
                nursery.start_soon(one, i, name)
        for i, name in enumerate(order):
            assert got[i] == alone[name], (i, name)
        # six streams of 24 tokens in far fewer than 6 x 24 steps: they decoded together
        assert (await settled(engine)).steps - steps < 3 * 24
        assert not engine._worker.adapters.of  # no row's adapter left behind


async def test_cancel_with_adapters(random_model_dir: Path, adapters: dict[str, Path]) -> None:
    async with open_engine(random_model_dir, adapters=served(adapters)) as engine:
        ids = prompts()[0]
        want = (await tokens(engine, ids, 12, adapters="zebra"))[0]
        result: dict[str, Any] = {}

        async def long() -> None:
            events, _ = await run(engine, raw(ids, max_tokens=4000, ignore_eos=True, adapters="fox"),
                                  request_id="long")
            result["long"] = events[-2]

        async def short() -> None:
            result["short"] = (await tokens(engine, ids, 12, adapters="zebra"))[0]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long)
            await trio.sleep(0.3)
            nursery.start_soon(short)
            await trio.sleep(0.3)
            assert engine.cancel("long")
        assert result["long"] == Finish("cancelled") and result["short"] == want
        stats = await settled(engine)
        assert stats.running == 0 and not engine._worker.adapters.of


async def test_prefix_cache_never_crosses_adapters(random_model_dir: Path, adapters: dict[str, Path]) -> None:
    async with open_engine(random_model_dir, adapters=served(adapters), prefix_cache_bytes=0) as engine:
        ids = prompts()[1]
        alone = {name: (await tokens(engine, ids, adapters=name))[0] for name in ("fox", "zebra")}
        alone[None] = (await tokens(engine, ids))[0]
    async with open_engine(random_model_dir, adapters=served(adapters)) as engine:
        for name in ("fox", None, "zebra", "fox", None):
            kw = {} if name is None else {"adapters": name}
            out, _ = await tokens(engine, ids, **kw)
            assert out == alone[name], name
        # each adapter's second request (and the base's) found its own entry; the first ones none
        stats = engine.statistics()
        assert stats.prefix_cache_hits == 2
        # the same prompt at once on three adapters: no prefill is shared between them
        got: dict[str | None, str] = {}

        async def one(name: str | None) -> None:
            got[name] = (await tokens(engine, [7, *ids], **({} if name is None else {"adapters": name})))[0]

        async with trio.open_nursery() as nursery:
            for name in (None, "fox", "zebra"):
                nursery.start_soon(one, name)
        assert engine.statistics().shared_prefills == 0
    async with open_engine(random_model_dir, adapters=served(adapters), prefix_cache_bytes=0) as engine:
        for name in (None, "fox", "zebra"):
            assert got[name] == (await tokens(engine, [7, *ids], **({} if name is None else {"adapters": name})))[0]


async def test_unknown_adapters_and_plain_colon_models(random_model_dir: Path, adapters: dict[str, Path]) -> None:
    async with open_engine(random_model_dir, adapters=served(adapters)) as engine:
        for bad in ({"adapters": "nope"}, {"model": "tiny:nope"}):
            with pytest.raises(AdapterNotFoundError) as info:
                await collect(engine, req("hi", **bad))
            assert info.value.status == 404 and info.value.code == "adapter_not_found"
        # a served adapter's directory names it too (mlx_lm.server's field holds a path)
        by_path = await tokens(engine, prompts()[0], adapters=str(adapters["fox"]))
        assert by_path[0] == (await tokens(engine, prompts()[0], adapters="fox"))[0]
    async with open_engine(random_model_dir) as engine:
        # no adapters served: a ':' in a name that is not this model's is just a name
        await collect(engine, req("hi", model="llama3:8b", max_tokens=2))
        with pytest.raises(AdapterNotFoundError):
            await collect(engine, req("hi", model=f"{engine.model_id}:fox", max_tokens=2))


async def test_bad_adapters_fail_the_start(random_model_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    with pytest.RaisesGroup(pytest.RaisesExc(ModelLoadError, match="not an mlx-lm adapter directory"),
                            flatten_subgroups=True):
        async with open_engine(random_model_dir, adapters=(("x", str(tmp_path)),), warmup=False):
            pass
    with pytest.raises(ValueError, match="adapter names"):
        async with open_engine(random_model_dir, adapters=(("a:b", str(adapters["fox"])),)):
            pass


def test_completion_request_carries_the_adapter() -> None:
    assert CompletionRequest.from_openai({"adapters": ["fox"]}, "x").adapter == "fox"
    assert CompletionRequest.from_openai({}, "x").adapter is None


async def test_grammar_profile_progress_and_logprobs_with_adapters(random_model_dir: Path,
                                                                   adapters: dict[str, Path]) -> None:
    import json

    from afm_core import Profile, PromptProgress

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    async with open_engine(random_model_dir, adapters=served(adapters)) as engine:

        async def one(name: str, seed: int) -> None:
            r = req("json please", response_format=rf, temperature=1.0, seed=seed, max_tokens=40,
                    enable_thinking=False, adapters=name, logprobs=True)
            async with engine.stream(r, profile="basic", progress=True) as s:
                events = [e async for e in s]
            body = "".join(e.text for e in events if type(e).__name__ == "ContentDelta")
            assert set(json.loads(body)) == {"ok"}
            assert any(isinstance(e, Profile) for e in events)
            assert any(isinstance(e, PromptProgress) for e in events)
            assert any(type(e).__name__ == "LogprobsDelta" for e in events)

        async with trio.open_nursery() as nursery:
            for seed, name in enumerate(("fox", "zebra", "fox")):
                nursery.start_soon(one, name, seed)
