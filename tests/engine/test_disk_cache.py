"""The prefix cache's disk tier (``EngineConfig.cache_dir``) on the random
tiny model: an engine opened again on the same directory (a restart) serves
a prompt the first one served from disk, computing only the tokens it does
not hold, with the output a cold engine gives; corrupt or truncated files
are deleted, never served; the byte budget evicts the least recently used;
another model's files are left alone; the disk may be the only tier."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from afm_core import (
    CompletionRequest,
    EngineConfig,
    Finish,
    LogprobsDelta,
    Profile,
    Usage,
    open_engine,
)
from afm_core._engine.config import DistributedConfig
from afm_core._engine.engine import Engine, EngineStatistics
from afm_core._mlx.cache_file import read_entry, read_header
from afm_core.testing import make_random_model
from tests.engine.test_engine import settled

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def raw(ids: list[int], **kw: Any) -> CompletionRequest:
    return CompletionRequest.from_openai(
        {"temperature": 0, "ignore_eos": True, "logprobs": 0, "max_tokens": 8, **kw}, tuple(ids))


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


async def run(engine: Engine, ids: list[int], **kw: Any) -> tuple[list[str], Usage, dict[str, Any]]:
    """The generated tokens, the usage and the profile of one greedy request."""
    async with engine.stream(raw(ids, **kw), profile="basic") as s:
        events = [e async for e in s]
    toks = [t.token for e in events if isinstance(e, LogprobsDelta) for t in e.content]
    usage = next(e for e in events if isinstance(e, Usage))
    profile = next(e for e in events if isinstance(e, Profile)).payload
    return toks, usage, profile


async def written(engine: Engine, n: int) -> EngineStatistics:
    """The statistics once ``n`` entries have been written to disk (in the background)."""
    with trio.fail_after(30):
        while engine.statistics().prefix_cache_disk_writes < n:
            await trio.sleep(0.005)
    return await settled(engine)


def files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("afmkv-*.safetensors"))


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(tmp_path_factory.mktemp("other"), seed=1)


async def test_a_restart_serves_from_disk(random_model_dir: Path, tmp_path: Path) -> None:
    prompt = prompt_ids(300, 0)
    async with open_engine(random_model_dir, prefix_cache_bytes=0) as cold:
        expected, _, _ = await run(cold, prompt)
        turn2 = prompt + prompt_ids(40, 1)
        expected2, _, _ = await run(cold, turn2)
    async with open_engine(random_model_dir, cache_dir=tmp_path) as first:
        toks, usage, profile = await run(first, prompt)
        assert toks == expected and usage.cached_tokens == 0 and profile["prefix_tier"] is None
        await written(first, 1)
    assert len(files(tmp_path)) == 1  # the warm-up's entries are gone: only the request's
    async with open_engine(random_model_dir, cache_dir=tmp_path) as second:
        s = second.statistics()
        assert (s.prefix_cache_disk_entries, s.prefix_cache_disk_hits) == (1, 0)
        assert s.prefix_cache_disk_bytes == files(tmp_path)[0].stat().st_size
        # the same prompt: everything but its last token comes from disk
        toks, usage, profile = await run(second, prompt)
        assert toks == expected
        assert usage.cached_tokens == len(prompt) - 1 and profile["prefix_tier"] == "disk"
        s = await settled(second)
        assert s.prompt_tokens - s.cached_tokens == 1  # what the prefill computed
        assert (s.prefix_cache_disk_hits, s.prefix_cache_memory_hits, s.prefix_cache_hits) == (1, 0, 1)
        assert s.prefix_cache_disk_read_bytes == s.prefix_cache_disk_bytes
        # read once: the entry is in memory now, the next request is served from there
        toks, usage, profile = await run(second, prompt)
        assert toks == expected and profile["prefix_tier"] == "memory"
        s = await settled(second)
        assert (s.prefix_cache_disk_hits, s.prefix_cache_memory_hits) == (1, 1)
    async with open_engine(random_model_dir, cache_dir=tmp_path) as third:
        # the next turn of the conversation: its first 300 + 8 tokens' cache
        # (the prompt and what was generated) is trimmed to the common prefix
        toks, usage, profile = await run(third, turn2)
        assert toks == expected2 and profile["prefix_tier"] == "disk"
        assert usage.cached_tokens == len(prompt)
        s = await settled(third)
        assert s.prompt_tokens - s.cached_tokens == len(turn2) - len(prompt)


async def test_corrupt_and_truncated_files_are_deleted_never_served(random_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    prompts = [prompt_ids(200, seed) for seed in range(3)]
    async with open_engine(random_model_dir, prefix_cache_bytes=0) as cold:
        expected = [(await run(cold, p))[0] for p in prompts]
    async with open_engine(random_model_dir, cache_dir=tmp_path) as first:
        for p in prompts:
            await run(first, p)
        await written(first, 3)
    by_size = files(tmp_path)
    assert len(by_size) == 3
    names = {read_header(path).tokens[:200]: path for path in by_size}
    flipped, cut, header = (names[tuple(p)] for p in prompts)
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor: found by the checksum, at the read
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-64])  # truncated: found at start (the length)
    data = bytearray(header.read_bytes())
    at = data.index(b'"0.tokens":"[') + 13
    data[at] = ord("9") if data[at] != ord("9") else ord("8")  # another token id: same length, valid JSON
    header.write_bytes(bytes(data))
    altered = list(read_header(header).tokens[:200])
    assert altered != prompts[2][:200]
    async with open_engine(random_model_dir, cache_dir=tmp_path, prefix_cache_bytes=0) as second:
        s = second.statistics()
        assert (s.prefix_cache_disk_entries, s.prefix_cache_disk_corrupt) == (2, 1)  # found at start: cut
        assert not cut.exists()
        # the altered token ids match this prompt: the file is read, and its checksum fails
        _, usage, profile = await run(second, altered)
        assert usage.cached_tokens == 0 and profile["prefix_tier"] is None
        s = await settled(second)
        assert s.prefix_cache_disk_corrupt == 2 and not header.exists()
        for p, want in zip(prompts, expected, strict=True):
            toks, usage, profile = await run(second, p)
            assert toks == want
            assert usage.cached_tokens == 0 and profile["prefix_tier"] is None
        s = await written(second, 4)
        assert s.prefix_cache_disk_corrupt == 3 and s.prefix_cache_disk_hits == 0
        assert s.prefix_cache_disk_read_bytes == 0 and s.prefix_cache_disk_entries == 4
    for path in files(tmp_path):  # each written again, intact
        read_entry(path)
    async with open_engine(random_model_dir, cache_dir=tmp_path) as third:
        for p, want in zip(prompts, expected, strict=True):
            toks, usage, profile = await run(third, p)
            assert toks == want and profile["prefix_tier"] == "disk"


async def test_the_budget_evicts_the_least_recently_used(random_model_dir: Path, tmp_path: Path) -> None:
    a, b, c = (prompt_ids(200, seed) for seed in (10, 11, 12))
    async with open_engine(random_model_dir, cache_dir=tmp_path, prefix_cache_bytes=0) as probe:
        await run(probe, a)
        size = (await written(probe, 1)).prefix_cache_disk_bytes
    for path in files(tmp_path):
        path.unlink()
    budget = int(size * 2.5)  # two entries fit
    async with open_engine(random_model_dir, cache_dir=tmp_path, prefix_cache_bytes=0,
                           cache_disk_bytes=budget) as engine:
        await run(engine, a)
        await run(engine, b)
        await written(engine, 2)
        # a is used again (read from disk: the disk is the only tier), so b is the oldest
        assert (await run(engine, a))[2]["prefix_tier"] == "disk"
        await written(engine, 3)  # (a's entry again: the same tokens, a file as new)
        await run(engine, c)
        s = await written(engine, 4)
        assert s.prefix_cache_disk_bytes <= budget and s.prefix_cache_disk_entries == 2
        assert s.prefix_cache_disk_evictions == 1
        assert (await run(engine, b))[2]["prefix_tier"] is None
        assert (await run(engine, c))[2]["prefix_tier"] == "disk"
    assert sum(p.stat().st_size for p in files(tmp_path)) <= budget
    # after a restart, the order of use comes from the files' times: the oldest goes first
    async with open_engine(random_model_dir, cache_dir=tmp_path, prefix_cache_bytes=0,
                           cache_disk_bytes=budget) as engine:
        s = engine.statistics()
        assert s.prefix_cache_disk_entries == 2 and s.prefix_cache_disk_bytes <= budget


async def test_another_models_entries_are_ignored(random_model_dir: Path, other_model_dir: Path,
                                                  tmp_path: Path) -> None:
    prompt = prompt_ids(200, 5)
    async with open_engine(random_model_dir, cache_dir=tmp_path) as mine:
        await run(mine, prompt)
        await written(mine, 1)
    theirs_before = files(tmp_path)
    async with open_engine(other_model_dir, cache_dir=tmp_path) as other:
        assert other.statistics().prefix_cache_disk_entries == 0
        _, usage, profile = await run(other, prompt)
        assert usage.cached_tokens == 0 and profile["prefix_tier"] is None
        await written(other, 1)
    assert set(theirs_before) < set(files(tmp_path))  # both models' files are there
    async with open_engine(random_model_dir, cache_dir=tmp_path) as mine:
        assert mine.statistics().prefix_cache_disk_entries == 1
        assert (await run(mine, prompt))[2]["prefix_tier"] == "disk"


async def test_the_disk_alone_and_the_memory_first(random_model_dir: Path, tmp_path: Path) -> None:
    prompt = prompt_ids(150, 7)
    async with open_engine(random_model_dir, cache_dir=tmp_path / "a", prefix_cache_bytes=0) as engine:
        first, _, _ = await run(engine, prompt)
        await written(engine, 1)
        toks, usage, profile = await run(engine, prompt)
        assert toks == first and profile["prefix_tier"] == "disk" and usage.cached_tokens == len(prompt) - 1
        s = await settled(engine)
        assert s.prefix_cache_bytes == 0 and s.prefix_cache_disk_hits == 1
    async with open_engine(random_model_dir, cache_dir=tmp_path / "b") as engine:
        await run(engine, prompt)
        await written(engine, 1)
        toks, _, profile = await run(engine, prompt)
        assert toks == first and profile["prefix_tier"] == "memory"
        s = await settled(engine)
        assert (s.prefix_cache_memory_hits, s.prefix_cache_disk_hits, s.prefix_cache_disk_read_bytes) == (1, 0, 0)
        assert s.prefix_cache_memory_misses == 1  # the first request


async def test_decoding_goes_on_while_an_entry_is_read(random_model_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests matching one entry wait for one read (on the I/O thread) out of
    the batch: another request decodes meanwhile; one cancelled while it
    waits ends ``cancelled`` and leaves the others alone."""
    from afm_core._mlx import disk_cache

    prompt, other = prompt_ids(250, 9), prompt_ids(30, 99)
    async with open_engine(random_model_dir, cache_dir=tmp_path) as engine:
        expected, _, _ = await run(engine, prompt)
        await written(engine, 1)
    (entry,) = files(tmp_path)
    size = entry.stat().st_size
    gate, reading = threading.Event(), threading.Event()
    real = disk_cache.read_entry

    def held_read(path: Path) -> Any:
        reading.set()
        gate.wait(30)
        return real(path)

    monkeypatch.setattr(disk_cache, "read_entry", held_read)
    async with open_engine(random_model_dir, cache_dir=tmp_path) as engine:
        worker = engine._worker
        assert worker is not None
        results: list[Any] = []

        async def one() -> None:
            results.append(await run(engine, prompt))

        try:
            async with trio.open_nursery() as n:
                for _ in range(2):
                    n.start_soon(one)
                async with engine.stream(raw(prompt), request_id="leaves") as leaving:
                    with trio.fail_after(30):
                        while len(worker.loading) < 3:
                            await trio.sleep(0.005)
                    await trio.to_thread.run_sync(reading.wait)
                    # the read is held: a request the disk does not hold runs to its end
                    toks, usage, _ = await run(engine, other)
                    assert len(toks) == 8 and usage.cached_tokens == 0
                    assert engine.cancel("leaves")
                    events = [e async for e in leaving]
                    assert isinstance(events[-2], Finish) and events[-2].reason == "cancelled"
                gate.set()
        finally:
            gate.set()
        assert [r[0] for r in results] == [expected] * 2
        assert [r[2]["prefix_tier"] for r in results] == ["disk"] * 2
        s = await settled(engine)
        assert s.prefix_cache_disk_read_bytes == size  # read once
        assert s.requests_active == 0 and not worker.loading


def test_refused_with_distributed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_dir"):
        EngineConfig(cache_dir=str(tmp_path), distributed=DistributedConfig())
    with pytest.raises(ValueError, match="cache_disk_bytes"):
        EngineConfig(cache_disk_bytes=-1)


def test_serve_flags_and_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from afm_http._metrics import render
    from afm_http._serve_cli import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--cache-dir", str(tmp_path), "--cache-disk-bytes", "1000"])
    assert (args.cache_dir, args.cache_disk_bytes) == (str(tmp_path), 1000)
    assert parser.parse_args([]).cache_dir is None
    args = parser.parse_args(["--cache-dir", str(tmp_path), "--distributed", "tensor"])
    assert run(args) == 1
    assert "--cache-dir cannot be used with --distributed" in capsys.readouterr().err
    stats = EngineStatistics(running=0, waiting=0, requests_total=0, requests_active=0, prompt_tokens=0,
                             cached_tokens=0, generation_tokens=0, prefix_cache_hits=3, prefix_cache_lookups=5,
                             prefix_cache_bytes=0, steps=0, ttft_seconds_sum=0.0, ttft_count=0,
                             prefix_cache_memory_hits=1, prefix_cache_memory_misses=4, prefix_cache_disk_hits=2,
                             prefix_cache_disk_misses=2, prefix_cache_disk_bytes=4096)
    lines = render([(stats, "m")], {}).splitlines()
    for line in ('afm_prefix_cache_memory_hits_total{model="m"} 1', 'afm_prefix_cache_memory_misses_total{model="m"} 4',
                 'afm_prefix_cache_disk_hits_total{model="m"} 2', 'afm_prefix_cache_disk_misses_total{model="m"} 2',
                 'afm_prefix_cache_disk_bytes{model="m"} 4096'):
        assert line in lines


_SERVE_AND_WAIT = """
import sys, trio
import afm_core
from afm_core import CompletionRequest, open_engine

async def main():
    async with open_engine(sys.argv[1], cache_dir=sys.argv[2]) as engine:
        ids = tuple(int(t) for t in sys.argv[3].split(","))
        async with engine.stream(CompletionRequest.from_openai({"temperature": 0, "max_tokens": 4}, ids)) as s:
            async for _ in s:
                pass
        while engine.statistics().prefix_cache_disk_writes < 1:
            await trio.sleep(0.01)
        print("written", flush=True)
        await trio.sleep(600)

trio.run(main)
"""


async def test_what_a_killed_server_served_is_found_again(random_model_dir: Path, tmp_path: Path) -> None:
    """Write-through: the cache of a request that finished before a kill -9 is
    on disk; the next engine on the directory serves its prompt from there."""
    import os
    import signal
    import subprocess
    import sys

    prompt = prompt_ids(120, 21)
    root = ROOT
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", _SERVE_AND_WAIT, str(random_model_dir), str(tmp_path), ",".join(map(str, prompt))],
        stdout=subprocess.PIPE, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert proc.stdout is not None
        with trio.fail_after(120):  # a hang guard, not a timing claim
            out = b""
            while b"written" not in out:
                chunk = await proc.stdout.receive_some()
                assert chunk, "the server process ended early"
                out += chunk
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL
    async with open_engine(random_model_dir, cache_dir=tmp_path) as engine:
        _, usage, profile = await run(engine, prompt)
        assert profile["prefix_tier"] == "disk" and usage.cached_tokens == len(prompt) - 1
