"""The prefix cache's disk tier with LoRA adapters (``EngineConfig.cache_dir``
and ``adapters``) on the random tiny model: an adapted entry is written,
served from disk (tokens equal to a cold run) and survives a restart with
the same adapter; it never serves another adapter, the base model, other
weights under the same name, or another ``kv_bits``; the same weights under
another name are served (entries are keyed by content, not name)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import trio

from afm_core import open_engine
from afm_core._engine.engine import Engine
from afm_core.testing import make_lora_adapter, make_random_model
from tests.engine.test_disk_cache import files, prompt_ids, run, written
from tests.engine.test_engine import settled


@pytest.fixture(scope="module")
def dirs(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    fox = make_lora_adapter(random_model_dir, root / "fox")
    zebra = make_lora_adapter(random_model_dir, root / "zebra", rank=4, seed=1,
                              texts=("Zebra yak zebra yak. " * 10, "ok ok ok ok ok ok ok ok " * 5))
    # fox's weights under another scale: other content (and other tokens), same file names
    altered = root / "fox-altered"
    shutil.copytree(fox, altered)
    config = json.loads((altered / "adapter_config.json").read_text())
    config["lora_parameters"]["scale"] = 5.0
    (altered / "adapter_config.json").write_text(json.dumps(config))
    return {"fox": fox, "zebra": zebra, "altered": altered}


async def stored(engine: Engine, n: int) -> None:
    """Wait until the disk tier indexes ``n`` entries.  (Its write count is no
    measure here: a disk hit's request saves its cache again, a rewrite of the
    same entry that may land before or after the next request's write.)"""
    with trio.fail_after(30):
        while engine.statistics().prefix_cache_disk_entries < n:
            await trio.sleep(0.005)
    await settled(engine)


def pairs(**named: Path) -> tuple[tuple[str, str], ...]:
    return tuple((name, str(path)) for name, path in named.items())


def adapter(name: str | None) -> dict[str, str]:
    return {} if name is None else {"adapters": name}


async def test_adapted_entries_on_disk(random_model_dir: Path, dirs: dict[str, Path], tmp_path: Path) -> None:
    prompt = prompt_ids(200, 3)
    every = pairs(fox=dirs["fox"], zebra=dirs["zebra"], altered=dirs["altered"])
    async with open_engine(random_model_dir, prefix_cache_bytes=0, adapters=every) as cold:
        want = {name: (await run(cold, prompt, **adapter(name)))[0] for name in ("fox", "zebra", "altered", None)}
    assert len({tuple(v) for v in want.values()}) == 4  # each adapter changes the tokens
    served = pairs(fox=dirs["fox"], zebra=dirs["zebra"])
    # the disk is the only tier: what a request computed is served from the disk alone
    async with open_engine(random_model_dir, cache_dir=tmp_path, prefix_cache_bytes=0, adapters=served) as first:
        toks, usage, profile = await run(first, prompt, adapters="fox")
        assert toks == want["fox"] and profile["prefix_tier"] is None and usage.cached_tokens == 0
        await written(first, 1)
        toks, usage, profile = await run(first, prompt, adapters="fox")
        assert toks == want["fox"] and profile["prefix_tier"] == "disk"
        assert usage.cached_tokens == len(prompt) - 1
        # fox's entry serves neither zebra nor the base model
        for n, name in enumerate(("zebra", None), start=2):
            toks, usage, profile = await run(first, prompt, **adapter(name))
            assert toks == want[name] and profile["prefix_tier"] is None and usage.cached_tokens == 0, name
            await stored(first, n)
        s = first.statistics()
        assert (s.prefix_cache_disk_hits, s.prefix_cache_disk_entries) == (1, 3)
    assert len(files(tmp_path)) == 3
    async with open_engine(random_model_dir, cache_dir=tmp_path, prefix_cache_bytes=0, adapters=served) as second:
        assert second.statistics().prefix_cache_disk_entries == 3
        for name in ("fox", "zebra", None):  # each its own entry, after a restart
            toks, usage, profile = await run(second, prompt, **adapter(name))
            assert toks == want[name] and profile["prefix_tier"] == "disk", name
            assert usage.cached_tokens == len(prompt) - 1
        assert second.statistics().prefix_cache_disk_hits == 3
    # "fox" is now other weights: its old entry is another model's; fox's
    # weights under another name are the same adapter, its entry serves them
    renamed = pairs(fox=dirs["altered"], renamed=dirs["fox"])
    async with open_engine(random_model_dir, cache_dir=tmp_path, prefix_cache_bytes=0, adapters=renamed) as third:
        toks, usage, profile = await run(third, prompt, adapters="fox")
        assert toks == want["altered"] and profile["prefix_tier"] is None and usage.cached_tokens == 0
        toks, usage, profile = await run(third, prompt, adapters="renamed")
        assert toks == want["fox"] and profile["prefix_tier"] == "disk"
    async with open_engine(random_model_dir, cache_dir=tmp_path, adapters=pairs(zebra=dirs["zebra"])) as fourth:
        assert fourth.statistics().prefix_cache_disk_entries == 2  # zebra's and the base model's (fox's: not its)


@pytest.fixture(scope="module")
def kv_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose head size (64) a quantized KV cache takes."""
    return make_random_model(tmp_path_factory.mktemp("kv"), hidden_size=256, num_heads=4, num_kv_heads=2)


async def test_adapted_entries_with_kv_bits(kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                            tmp_path: Path) -> None:
    random_model_dir = kv_model_dir
    prompt = prompt_ids(150, 4)
    served = pairs(fox=make_lora_adapter(kv_model_dir, tmp_path_factory.mktemp("kv-adapter") / "fox"))
    async with open_engine(random_model_dir, prefix_cache_bytes=0, kv_bits=8, adapters=served) as cold:
        want = (await run(cold, prompt, adapters="fox"))[0]
    async with open_engine(random_model_dir, cache_dir=tmp_path, kv_bits=8, adapters=served) as first:
        assert (await run(first, prompt, adapters="fox"))[0] == want
        await written(first, 1)
    async with open_engine(random_model_dir, cache_dir=tmp_path, kv_bits=8, adapters=served) as second:
        toks, usage, profile = await run(second, prompt, adapters="fox")
        assert toks == want and profile["prefix_tier"] == "disk" and usage.cached_tokens == len(prompt) - 1
        # read once, it moved into the memory tier under fox's key: served from there next
        toks, _, profile = await run(second, prompt, adapters="fox")
        assert toks == want and profile["prefix_tier"] == "memory"
        assert (await run(second, prompt))[2]["prefix_tier"] is None  # (not the base model's)
    async with open_engine(random_model_dir, cache_dir=tmp_path, adapters=served) as floats:
        # a float KV cache: the quantized entry is another format's
        assert floats.statistics().prefix_cache_disk_entries == 0
        toks, usage, profile = await run(floats, prompt, adapters="fox")
        assert profile["prefix_tier"] is None and usage.cached_tokens == 0
