"""The statistics record (``afm_core._engine.stats``): every statistic declared
once, on ``EngineStatistics``, with the metadata ``/metrics`` and ``/health``
read; the generation thread's counters copied into it by name."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from afm_core import CompletionRequest, EngineStatistics, open_engine
from afm_core._engine.stats import WORKER_COUNTERS, Metric, WorkerStats, counter, gauge
from afm_http._metrics import render


def test_each_metric_is_declared_once_and_well_formed() -> None:
    metrics = EngineStatistics.metrics()
    names = [m.name for _, m in metrics]
    assert len(names) == len(set(names)) and len(metrics) >= 30
    for attr, m in metrics:
        assert isinstance(m, Metric) and m.name.startswith("afm_") and m.help.endswith(".")
        assert m.kind in ("counter", "gauge")
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert attr in {f.name for f in fields(EngineStatistics)}
    assert EngineStatistics.health_fields() == ("running", "waiting", "requests_active")


def test_the_metadata_helpers() -> None:
    assert counter("afm_x_total", "X.") == {"metric": Metric("afm_x_total", "counter", "X."), "health": False}
    assert gauge("afm_y", "Y.", health=True)["health"] is True


def test_metrics_renders_every_declared_field() -> None:
    values = {f.name: 0 for f in fields(EngineStatistics) if f.name != "finished"}
    values.update(running=3, prompt_tokens=11, ttft_seconds_sum=0.0, blas="")
    stats = EngineStatistics(**values)  # type: ignore[arg-type]
    lines = render([(stats, "m")], {}).splitlines()
    for attr, m in EngineStatistics.metrics():
        assert f"# TYPE {m.name} {m.kind}" in lines
        assert f'{m.name}{{model="m"}} {getattr(stats, attr)}' in lines
    assert 'afm_requests_running{model="m"} 3' in lines
    assert 'afm_prompt_tokens_total{model="m"} 11' in lines


def test_the_thread_s_counters_are_statistics_by_name() -> None:
    statistic = {f.name for f in fields(EngineStatistics)}
    counted = {f.name for f in fields(WorkerStats)}
    assert set(WORKER_COUNTERS) == (statistic & counted) - {"finished"}
    assert {"prompt_tokens", "prefix_cache_disk_hits", "spec_accepted", "kept_prefixes"} <= set(WORKER_COUNTERS)
    # the thread's own (not statistics): never copied
    assert not {"prefilling", "queued", "computed_prompt_tokens", "parked"} & set(WORKER_COUNTERS)


async def test_an_engine_s_statistics_carry_the_thread_s_counts(random_model_dir: Path) -> None:
    async with open_engine(random_model_dir, warmup=False, max_batch=2) as engine:
        before = engine.statistics()
        assert before.prompt_tokens == 0 and before.requests_total == 0
        request = CompletionRequest.from_openai({"max_tokens": 3, "temperature": 0, "ignore_eos": True}, (5, 6, 7, 8))
        async with engine.stream(request) as stream:
            async for _ in stream:
                pass
        after = engine.statistics()
    assert after.prompt_tokens == 4 and after.generation_tokens == 3
    assert after.requests_total == 1 and after.prefix_cache_lookups == 1
    assert after.prefix_cache_memory_misses == 1  # a fresh cache: looked up, not served
    assert after.finished == {"length": 1}
