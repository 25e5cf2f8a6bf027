"""Tests for ``afm bench``: stats, workloads, SSE parsing, the load generator
against stub servers, the report, and a short end-to-end run against
``mlx_lm.server`` on the random tiny model."""

from __future__ import annotations

import itertools
import json
import math
import random
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import trio

import afm_core.bench as bench
from afm_core.bench._http import read_request
from afm_core.bench._loadgen import SSEParser, StreamObserver, Target, require_loopback
from afm_core.bench._report import build_report, compare, format_table
from afm_core.bench._results import RequestResult, RunResult
from afm_core.bench._stats import percentile, ratio, summarize
from afm_core.bench._workload import make_workload, poisson_schedule

# --- stats ------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    xs = rng.exponential(3.0, size=n).tolist()
    for q in (0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0  # unsorted input


def test_summarize_and_ratio() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    s = summarize(xs)
    assert (s.count, s.min, s.max, s.mean) == (4, 1.0, 4.0, 2.5)
    assert s.p50 == pytest.approx(float(np.percentile(xs, 50)))
    assert s.p99 == pytest.approx(float(np.percentile(xs, 99)))
    empty = summarize([]).as_dict()
    assert empty["count"] == 0 and empty["p50"] is None
    assert ratio(1.0, 2.0) == 0.5
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None and ratio(math.nan, 1.0) is None


# --- workloads ----------------------------------------------------------------


def test_workload_is_seeded() -> None:
    a = make_workload(7, 50, prompt_words=(5, 9), max_tokens=(3, 6))
    b = make_workload(7, 50, prompt_words=(5, 9), max_tokens=(3, 6))
    c = make_workload(8, 50, prompt_words=(5, 9), max_tokens=(3, 6))
    assert a == b
    assert a.jobs != c.jobs
    for job in a.jobs:
        words = job.messages[-1]["content"].split()
        assert 3 <= job.max_tokens <= 6
        # a task line of 3-7 words, then 5..9 drawn words
        assert 5 + 3 <= len(words) <= 9 + 7
    assert len({j.messages[-1]["content"] for j in a.jobs}) > 40
    assert a.job(53) == a.jobs[3]
    # unaffected by the global random state
    random.seed(123)
    assert make_workload(7, 50, prompt_words=(5, 9), max_tokens=(3, 6)) == a


def test_job_body() -> None:
    job = make_workload(0, 1, max_tokens=8).jobs[0]
    body = job.body(model=None)
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 8
    assert "model" not in body and "seed" not in body  # a seed disables mlx_lm batching
    assert job.body(model="/m")["model"] == "/m"
    with pytest.raises(ValueError):
        make_workload(0, 0)


def test_poisson_schedule() -> None:
    s = poisson_schedule(50.0, 20000, seed=3)
    assert s == poisson_schedule(50.0, 20000, seed=3)
    assert s != poisson_schedule(50.0, 20000, seed=4)
    assert len(s) == 20000 and s[0] > 0
    assert all(b > a for a, b in itertools.pairwise(s))
    gaps = np.diff([0.0, *s])
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.05)
    # exponential gaps: the coefficient of variation is 1
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    assert poisson_schedule(1.0, 0, seed=0) == []
    with pytest.raises(ValueError):
        poisson_schedule(0.0, 3, seed=0)


# --- SSE parsing ----------------------------------------------------------------

STREAM = (
    b": keepalive 1/2\n\n"
    b'data: {"choices":[{"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"delta":{"content":" there"},"finish_reason":null}]}\r\n\r\n'
    b"event: message\nid: 4\ndata: line one\ndata: line two\n\n"
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\r\r'
    b"data: [DONE]\n\n"
)
EVENTS = [
    '{"choices":[{"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}',
    '{"choices":[{"delta":{"content":" there"},"finish_reason":null}]}',
    "line one\nline two",
    '{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}',
    "[DONE]",
]


def test_sse_parser_whole() -> None:
    p = SSEParser()
    assert p.feed(STREAM) + p.flush() == EVENTS


def test_sse_parser_every_split() -> None:
    for cut in range(len(STREAM) + 1):
        p = SSEParser()
        assert p.feed(STREAM[:cut]) + p.feed(STREAM[cut:]) + p.flush() == EVENTS, cut


def test_sse_parser_random_chunks() -> None:
    rng = random.Random(0)
    for _ in range(200):
        p = SSEParser()
        out: list[str] = []
        i = 0
        while i < len(STREAM):
            j = i + rng.randint(1, 7)
            out += p.feed(STREAM[i:j])
            i = j
        assert out + p.flush() == EVENTS


def test_sse_parser_flush_unterminated() -> None:
    p = SSEParser()
    assert p.feed(b"data: a\n\ndata: b") == ["a"]
    assert p.flush() == ["b"]
    assert p.flush() == []


def _observe(payloads: list[tuple[float, str]]) -> RequestResult:
    r = RequestResult(index=0, start=10.0)
    obs = StreamObserver(r, 10.0)
    for t, data in payloads:
        obs.data(data, t)
    obs.finish(payloads[-1][0] if payloads else 10.0)
    return r


def _chunk(**delta: object) -> str:
    return json.dumps({"choices": [{"delta": delta, "finish_reason": None}]})


def test_observer_timings_and_usage() -> None:
    r = _observe([
        (10.05, _chunk(role="assistant")),  # no token yet
        (10.10, _chunk(reasoning_content="hmm")),
        (10.15, _chunk(content="a")),
        (10.30, _chunk(tool_calls=[{"index": 0, "function": {"arguments": "{"}}])),
        (10.31, json.dumps({"choices": [{"delta": {}, "finish_reason": "length"}]})),
        (10.32, json.dumps({"choices": [], "usage": {"prompt_tokens": 9,
                                                     "completion_tokens": 3}})),
        (10.33, json.dumps({"afm_profile_extended": {"summary": {"decode_tps": 5}}})),
        (10.34, "[DONE]"),
    ])
    assert r.ok
    assert r.ttft == pytest.approx(0.10)
    assert r.itls == pytest.approx([0.05, 0.15])
    assert (r.output_tokens, r.prompt_tokens, r.finish_reason) == (3, 9, "length")
    assert r.e2e == pytest.approx(0.34)
    assert r.profile == {"afm_profile_extended": {"summary": {"decode_tps": 5}}}


@pytest.mark.parametrize(
    ("payloads", "kind"),
    [
        ([(10.1, _chunk(content="a"))], "no_done"),
        ([(10.1, _chunk(content="a")), (10.2, "[DONE]")], "no_usage"),
        ([(10.1, '{"error": {"message": "boom"}}'), (10.2, "[DONE]")], "stream_error"),
        ([(10.1, "{not json"), (10.2, "[DONE]")], "bad_json"),
    ],
)
def test_observer_error_kinds(payloads: list[tuple[float, str]], kind: str) -> None:
    assert _observe(payloads).error == kind


def test_loopback_only() -> None:
    require_loopback("http://127.0.0.1:8080")
    require_loopback("http://localhost:1/v1")
    with pytest.raises(ValueError):
        require_loopback("http://example.com:8080")
    with pytest.raises(ValueError):
        require_loopback("http://10.0.0.1:8080")
    for url in ("https://127.0.0.1:8443", "127.0.0.1:8080", "localhost:8080"):
        with pytest.raises(ValueError, match="plain http"):
            require_loopback(url)


# --- the load generator against stub servers ---------------------------------------


def _sse_response(n_tokens: int) -> bytes:
    frames = [_chunk(role="assistant", content="t0")]
    frames += [_chunk(content=f" t{i}") for i in range(1, n_tokens)]
    frames.append(json.dumps({"choices": [], "usage": {"prompt_tokens": 4,
                                                       "completion_tokens": n_tokens}}))
    frames.append("[DONE]")
    return b"".join(f"data: {f}\n\n".encode() for f in frames)


async def _stub_server(nursery: trio.Nursery, *, stall: bool) -> int:
    """A minimal HTTP/1.1 server on 127.0.0.1: answers every request with an
    SSE body (or headers, one chunk and then silence when ``stall``)."""

    async def handle(stream: trio.SocketStream) -> None:
        req = await read_request(stream, bytearray())
        if req is None:
            return
        body = json.loads(req[1])
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                              b"Connection: close\r\n\r\n")
        if stall:
            await stream.send_all(f"data: {_chunk(content='x')}\n\n".encode())
            await trio.sleep_forever()
        await stream.send_all(_sse_response(body["max_tokens"]))
        await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


async def test_run_closed_against_stub() -> None:
    wl = make_workload(0, 10, max_tokens=(3, 6))
    async with trio.open_nursery() as nursery:
        port = await _stub_server(nursery, stall=False)
        run = await bench.run_closed(Target("stub", f"http://127.0.0.1:{port}"), wl, 3, 10,
                                     level_timeout=30, request_timeout=10)
        nursery.cancel_scope.cancel()
    assert [r.index for r in run.requests] == list(range(10))
    assert all(r.ok for r in run.requests), [r.error for r in run.requests]
    for r in run.requests:
        n = wl.job(r.index).max_tokens
        assert r.output_tokens == n and len(r.itls) == n - 1 and r.ttft is not None
    s = run.summary()
    assert s["ok"] == 10 and s["errors"] == {}
    assert s["output_tokens"] == sum(j.max_tokens for j in wl.jobs)
    assert s["client_cpu_s"] > 0 and s["client_cpu_share"] is not None


async def test_open_loop_against_stub() -> None:
    wl = make_workload(0, 8, max_tokens=4)
    sched = poisson_schedule(40.0, 8, seed=1)
    async with trio.open_nursery() as nursery:
        port = await _stub_server(nursery, stall=False)
        run = await bench.run_open(Target("stub", f"http://127.0.0.1:{port}"), wl, 40.0, sched,
                                   level_timeout=30, request_timeout=10, first_index=2)
        nursery.cancel_scope.cancel()
    assert run.mode == "open" and run.level == 40.0
    assert sorted(r.index for r in run.requests) == list(range(2, 10))
    assert all(r.ok and r.output_tokens == 4 for r in run.requests)
    # starts are the scheduled arrivals (relative to the level start)
    assert [r.start for r in run.requests] == pytest.approx(sched, abs=1e-9)


async def test_stalled_server_gives_timeouts_and_deadline() -> None:
    wl = make_workload(0, 4, max_tokens=4)
    async with trio.open_nursery() as nursery:
        port = await _stub_server(nursery, stall=True)
        target = Target("stub", f"http://127.0.0.1:{port}")
        timed = await bench.run_closed(target, wl, 2, 2, level_timeout=30, request_timeout=0.3)
        cut = await bench.run_closed(target, wl, 2, 4, level_timeout=0.3, request_timeout=30)
        nursery.cancel_scope.cancel()
    assert [r.error for r in timed.requests] == ["timeout", "timeout"]
    assert not timed.truncated
    assert cut.truncated
    assert [r.error for r in cut.requests] == ["deadline", "deadline"]  # 2 sent, 2 never


async def test_nothing_listening_is_a_connect_error() -> None:
    from afm_core.bench._servers import free_port

    port = free_port()
    run = await bench.run_closed(Target("none", f"http://127.0.0.1:{port}"),
                                 make_workload(0, 2), 1, 2, level_timeout=10, request_timeout=5)
    assert run.summary()["errors"] == {"connect": 2}


# --- the report -------------------------------------------------------------------------


def _run(target: str, level: int, tokens: int, ttft: float, duration: float = 1.0) -> RunResult:
    reqs = [RequestResult(index=i, ttft=ttft, e2e=ttft + 0.1, itls=[0.01, 0.02],
                          output_tokens=tokens) for i in range(4)]
    return RunResult(target, "closed", float(level), duration, reqs)


def test_report_ratios_and_table() -> None:
    runs = [_run("raw", 1, 100, 0.010), _run("mlx_lm.server", 1, 80, 0.012),
            _run("ours", 1, 96, 0.011), _run("raw", 8, 100, 0.02)]
    rep = build_report(runs, meta={"model": "/m/tiny"}, config={}, skipped={"x": "why"})
    assert rep["targets"] == ["raw", "mlx_lm.server", "ours"]
    c1 = rep["levels"][0]
    assert c1["label"] == "c=1"
    assert c1["vs_raw"]["ours"]["output_tokens_per_s"] == pytest.approx(0.96)
    assert c1["vs_raw"]["mlx_lm.server"]["output_tokens_per_s"] == pytest.approx(0.80)
    assert c1["vs_raw"]["ours"]["ttft_p50_delta_ms"] == pytest.approx(1.0)
    assert c1["ours_vs_peer"]["output_tokens_per_s"] == pytest.approx(96 / 80)
    assert "ours_vs_peer" not in rep["levels"][1]
    table = format_table(rep)
    assert "ours/peer" in table and "skipped x: why" in table and "c=8" in table
    json.dumps(rep, allow_nan=False)
    assert compare(c1["by_target"]["raw"], c1["by_target"]["raw"])["output_tokens_per_s"] == 1.0


def test_report_sets_ours_against_raw_with_the_engine_kernels() -> None:
    runs = [_run("raw", 1, 100, 0.010), _run("raw+kernels", 1, 150, 0.008), _run("ours", 1, 120, 0.011)]
    rep = build_report(runs, meta={}, config={}, skipped={})
    c1 = rep["levels"][0]
    assert c1["vs_raw"]["raw+kernels"]["output_tokens_per_s"] == pytest.approx(1.5)
    assert c1["ours_vs_raw_kernels"]["output_tokens_per_s"] == pytest.approx(0.8)
    assert c1["ours_vs_raw_kernels"]["ttft_p50_delta_ms"] == pytest.approx(3.0)
    table = format_table(rep)
    assert "ours/raw+k" in table and "ours/peer" not in table


@pytest.mark.parametrize("runs", [
    [_run("url", 8, 100, 0.01)],  # one level, no raw: the ratio panel has nothing to draw
    [RunResult("url", "closed", 1.0, 1.0, [RequestResult(index=0, error="connect")])],  # no latencies
    [RunResult("url", "open", 5.0, 1.0, [RequestResult(index=0, ttft=0.01, e2e=0.1, output_tokens=3)])],
], ids=["one-level-no-raw", "all-failed", "open-loop-only"])
def test_report_files_for_partial_runs(runs: list[RunResult], tmp_path: Path) -> None:
    from afm_core.bench._report import write_report

    rep = build_report(runs, meta={"model": "/m/tiny"}, config={}, skipped={})
    paths = write_report(rep, tmp_path)
    assert [p.name for p in paths] == ["report.json", "report.txt", "report.png"]
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounds_are_pooled_and_ratios_are_paired_medians() -> None:
    def rounds(target: str, tokens: list[int]) -> list[RunResult]:
        runs = [_run(target, 1, t, 0.010) for t in tokens]
        for r, run in enumerate(runs):
            run.round = r
        return runs

    # round 2 of raw ran in a burst of load from elsewhere (half speed)
    runs = rounds("raw", [100, 50, 100]) + rounds("ours", [96, 98, 94]) + rounds("mlx_lm.server", [80, 80, 80])
    rep = build_report(runs, meta={}, config={"rounds": 3}, skipped={})
    c1 = rep["levels"][0]
    raw, ours = c1["by_target"]["raw"], c1["by_target"]["ours"]
    assert raw["requests"] == 12 and raw["duration_s"] == pytest.approx(3.0)
    assert raw["output_tokens_per_s"] == pytest.approx(250 * 4 / 3)  # pooled
    assert ours["rounds"] == 3 and ours["output_tokens_per_s_by_round"] == pytest.approx([384, 392, 376])
    vs = c1["vs_raw"]["ours"]
    assert vs["output_tokens_per_s_by_round"] == pytest.approx([0.96, 1.96, 0.94])
    assert vs["output_tokens_per_s"] == pytest.approx(0.96)  # the median, not the pooled 1.152
    assert vs["output_tokens_per_s_pooled"] == pytest.approx(288 / 250)
    assert c1["ours_vs_peer"]["output_tokens_per_s"] == pytest.approx(96 / 80)
    table = format_table(rep)
    assert "3 rounds per level" in table and "0.960" in table
    json.dumps(rep, allow_nan=False)


def test_plan_gives_each_round_fresh_jobs() -> None:
    from afm_core.bench._run import BenchConfig, plan

    cfg = BenchConfig(model="/m", out_dir="/o", concurrency=(1, 8), requests=4, rates=(5.0,),
                      open_requests=3, warmup=2, rounds=2)
    workload, levels, warmup = plan(cfg)
    assert [(lv.level, lv.round, lv.first_index, lv.n) for lv in levels] == [
        (1.0, 0, 0, 4), (1.0, 1, 4, 4), (8.0, 0, 8, 4), (8.0, 1, 12, 4), (5.0, 0, 16, 3), (5.0, 1, 19, 3)]
    assert levels[4].schedule == levels[5].schedule
    assert warmup.first_index == 22 and len(workload.jobs) == 24
    with pytest.raises(ValueError):
        plan(BenchConfig(model="/m", out_dir="/o", rounds=0))


def test_interleaved_rounds_end_to_end(random_model_dir: Path, tmp_path: Path) -> None:
    from afm_core._cli import main

    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(random_model_dir), "--targets", "raw,raw_kernels",
               "--interleave", "--rounds", "2", "--concurrency", "2", "--requests", "3",
               "--max-tokens", "4", "--prompt-words", "8:16", "--warmup", "1",
               "--level-timeout", "30", "--time-budget", "60", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    (entry,) = rep["levels"]
    assert entry["by_target"]["raw"]["requests"] == 6 and entry["by_target"]["raw"]["ok"] == 6
    assert len(entry["vs_raw"]["raw+kernels"]["output_tokens_per_s_by_round"]) == 2
    assert "2 rounds per level" in (out / "report.txt").read_text()
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--rounds", "0", "--out", str(out)])
    assert exc.value.code == 2


def test_open_loop_only_run(random_model_dir: Path, tmp_path: Path) -> None:
    from afm_core._cli import main

    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(random_model_dir), "--targets", "raw", "--concurrency", "none",
               "--rate", "20", "--open-requests", "3", "--max-tokens", "4", "--prompt-words", "8:16",
               "--warmup", "1", "--level-timeout", "30", "--time-budget", "60", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert [(e["mode"], e["level"]) for e in rep["levels"]] == [("open", 20.0)]
    assert rep["levels"][0]["by_target"]["raw"]["ok"] == 3
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["bench", "--concurrency", "none", "--out", str(out)]) == 2  # nothing to run


def test_raw_with_the_engine_kernels(random_model_dir: Path, tmp_path: Path) -> None:
    from afm_core._cli import main

    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(random_model_dir), "--targets", "raw,raw_kernels",
               "--concurrency", "1,3", "--requests", "6", "--max-tokens", "8",
               "--prompt-words", "8:16", "--warmup", "1", "--level-timeout", "30",
               "--time-budget", "60", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["targets"] == ["raw", "raw+kernels"]
    for entry in rep["levels"]:
        for name in ("raw", "raw+kernels"):
            s = entry["by_target"][name]
            assert s["requests"] == 6 and s["ok"] == 6 and s["errors"] == {}, s
        assert entry["vs_raw"]["raw+kernels"]["output_tokens_per_s"] > 0
    assert "raw+kernels" not in rep["checks"]["prompt_tokens_vs_raw"]


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_raw_runner_tokenizes_each_prompt_once(random_model_dir: Path, api: str) -> None:
    """A level's timing holds generation only: ``prompt_tokens`` (run before
    any level) tokenizes every job once, in either prompt form, and a level
    reuses those ids."""
    workload = bench.make_workload(3, 4, prompt_words=(8, 12), max_tokens=2)
    runner = bench.RawRunner(random_model_dir, api=api)
    await runner.load()
    try:
        tok = runner._tokenizer
        calls = 0

        def counting(fn):
            def wrapped(*args, **kwargs):
                nonlocal calls
                calls += 1
                return fn(*args, **kwargs)
            return wrapped

        for name in ("encode", "apply_chat_template"):
            setattr(tok, name, counting(getattr(tok, name)))
        counts = await runner.prompt_tokens(workload)
        assert calls == 4 and all(n > 8 for n in counts)
        run = await runner.run_closed(workload, 2, 4, level_timeout=30)
        assert calls == 4 and [r.prompt_tokens for r in run.requests] == counts
    finally:
        await runner.aclose()


async def test_raw_runner_applies_and_frees_the_engine_kernels(random_model_dir: Path) -> None:
    from afm_core._mlx.fusion import wants_fusion

    def kinds(runner: bench.RawRunner) -> set[str]:
        return {type(m).__name__ for _, m in runner._model.named_modules()}

    plain, fused = bench.RawRunner(random_model_dir), bench.RawRunner(random_model_dir, kernels=True)
    for runner in (plain, fused):
        await runner.load()
    try:
        assert "_FusedRMSNorm" not in await plain._call(kinds, plain)
        assert ("_FusedRMSNorm" in await fused._call(kinds, fused)) is wants_fusion()
    finally:
        await plain.aclose()
        await fused.aclose()
    assert fused._model is None  # closed on its own thread, kernels freed there


def test_public_names() -> None:
    assert set(bench.__all__) == {
        "BenchConfig", "Job", "RawRunner", "RequestResult", "RunResult", "SSEParser",
        "StreamObserver", "Summary", "Target", "Workload", "build_report", "format_table",
        "make_workload", "percentile", "poisson_schedule", "run_bench", "run_closed",
        "run_open", "summarize", "write_report",
    }


# --- end to end: raw + mlx_lm.server on the tiny model ---------------------------------


@pytest.mark.parametrize("order", ["by-target", "interleave"])
def test_end_to_end_against_mlx_lm_server(random_model_dir: Path, tmp_path: Path,
                                          order: str) -> None:
    from afm_core._cli import main

    out = tmp_path / "bench"
    flags = ["--interleave"] if order == "interleave" else []
    rc = main(["bench", *flags, "--model", str(random_model_dir), "--targets", "raw,peer",
               "--concurrency", "1,2", "--requests", "4", "--max-tokens", "8",
               "--prompt-words", "8:16", "--warmup", "1", "--rate", "20",
               "--open-requests", "4", "--request-timeout", "20", "--level-timeout", "30",
               "--time-budget", "50", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mlx_lm.server" in (out / "report.txt").read_text()
    assert rep["targets"] == ["raw", "mlx_lm.server"]
    assert "time_budget" not in rep["skipped"]
    assert [(e["mode"], e["level"]) for e in rep["levels"]] == [
        ("closed", 1.0), ("closed", 2.0), ("open", 20.0)]
    for entry in rep["levels"]:
        for name in ("raw", "mlx_lm.server"):
            s = entry["by_target"][name]
            assert s["requests"] == 4 and s["ok"] == 4 and s["errors"] == {}, s
            assert 4 <= s["output_tokens"] <= 32
            assert s["output_tokens_per_s"] > 0
            for key in ("ttft_ms", "itl_ms", "e2e_ms"):
                assert set(s[key]) >= {"p50", "p90", "p99"}
            assert s["ttft_ms"]["count"] == 4
        r = entry["vs_raw"]["mlx_lm.server"]["output_tokens_per_s"]
        assert r is not None and r > 0
    # the server counted the same prompt tokens as the raw path's chat template
    check = rep["checks"]["prompt_tokens_vs_raw"]["mlx_lm.server"]
    assert check["checked"] == 12 and check["mismatched"] == 0
    assert rep["config"]["workload"]["seed"] == 0
    assert rep["config"]["interleave"] is (order == "interleave")
    assert list((out / "logs").glob("mlx_lm_server-*.log"))


def test_plan_uses_disjoint_jobs() -> None:
    from afm_core.bench._run import BenchConfig, plan

    cfg = BenchConfig(model="/m", out_dir="/o", concurrency=(1, 8), requests=None,
                      rates=(5.0,), open_requests=10, warmup=3)
    workload, levels, warmup = plan(cfg)
    spans = [(lv.first_index, lv.first_index + lv.n) for lv in [*levels, warmup]]
    assert [lv.n for lv in levels] == [32, 32, 10] and warmup.n == 3
    assert spans == [(0, 32), (32, 64), (64, 74), (74, 77)]
    assert len(workload.jobs) == 77  # every request a distinct prompt
    assert len(levels[2].schedule) == 10 and levels[2].mode == "open"
