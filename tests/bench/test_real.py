"""Tests for ``afm bench --real-model``: the report against llama.cpp (ratios,
table, plot) on fake results, the llama.cpp target's skip when
llama-cpp-python is missing, and a short run on the random tiny model.
Nothing here needs the real default model or llama-cpp-python."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from afm_core.bench import _servers
from afm_core.bench._loadgen import StreamObserver
from afm_core.bench._real import (
    RealConfig,
    calibrate_words,
    expected_seconds,
    make_phases,
    run_real,
)
from afm_core.bench._real_report import (
    build_real_report,
    decode_rates,
    format_real_table,
    write_real_report,
)
from afm_core.bench._results import RequestResult, RunResult

PHASES = [{"name": "decode", "title": "1 stream"}, {"name": "batch", "title": "8 streams"},
          {"name": "ttft", "title": "512-token prompts", "prompt_tokens_mean": 511.5}]


def _fake(target: str, phase: str, rnd: int, *, tpot: float, ttft: float, tokens: int = 33,
          n: int = 2, duration: float | None = None) -> RunResult:
    """``n`` requests of ``tokens`` tokens, ``tpot`` s per token after the first."""
    reqs = [RequestResult(index=i, ttft=ttft, e2e=ttft + tpot * (tokens - 1),
                          itls=[tpot] * (tokens - 1), output_tokens=tokens) for i in range(n)]
    dur = duration if duration is not None else n * (ttft + tpot * (tokens - 1))
    run = RunResult(target, phase, 1.0, dur, reqs)
    run.round = rnd
    return run


def _fake_runs(llama_decode: tuple[float, float] = (0.01, 0.01)) -> list[RunResult]:
    runs = []
    for rnd in (0, 1):
        # llama.cpp: 100 tok/s decode, 200 tok/s at C=8, 100 ms TTFT
        runs.append(_fake("llama.cpp", "decode", rnd, tpot=llama_decode[rnd], ttft=0.01))
        runs.append(_fake("llama.cpp", "batch", rnd, tpot=0.01, ttft=0.01, n=8, duration=8 * 33 / 200))
        runs.append(_fake("llama.cpp", "ttft", rnd, tpot=0.01, ttft=0.100, tokens=8))
        # ours: 50 tok/s decode, 400 tok/s at C=8, 300 ms TTFT
        runs.append(_fake("ours", "decode", rnd, tpot=0.02, ttft=0.01))
        runs.append(_fake("ours", "batch", rnd, tpot=0.02, ttft=0.02, n=8, duration=8 * 33 / 400))
        runs.append(_fake("ours", "ttft", rnd, tpot=0.02, ttft=0.300, tokens=8))
        runs.append(_fake("raw", "decode", rnd, tpot=0.025, ttft=0.01))
    return runs


SERVERS = {"llama.cpp": {"peak_rss_bytes": 200 * 2**20, "blas": {"name": "ggml"}},
           "ours": {"peak_rss_bytes": 800 * 2**20,
                    "blas": {"name": "openblas", "threads": 2, "verified": True}},
           "raw": {"peak_rss_bytes": 1000 * 2**20}}


def test_decode_rate_leaves_the_prefill_out() -> None:
    run = _fake("x", "decode", 0, tpot=0.02, ttft=5.0, tokens=11)
    assert decode_rates(run) == pytest.approx([50.0, 50.0])
    run.requests.append(RequestResult(index=9, error="connect"))
    run.requests.append(RequestResult(index=10, ttft=0.1, e2e=0.1, output_tokens=1))
    assert len(decode_rates(run)) == 2


def test_report_sets_every_figure_against_llamacpp(tmp_path: Path) -> None:
    rep = build_real_report(_fake_runs(), phases=PHASES, servers=SERVERS,
                            meta={"model": "/m/SmolLM2"}, config={"rounds": 2}, skipped={})
    assert rep["targets"] == ["llama.cpp", "ours", "raw"]
    ours = rep["headline"]["ours"]
    assert ours["decode_tok_s"] == pytest.approx(50.0)
    assert ours["batch_tok_s"] == pytest.approx(400.0)
    assert ours["ttft_p50_ms"] == pytest.approx(300.0)
    assert ours["peak_rss_mib"] == pytest.approx(800.0)
    vs = ours["vs_llama.cpp"]
    assert vs["decode_tok_s"] == pytest.approx(0.5)
    assert vs["batch_tok_s"] == pytest.approx(2.0)
    assert vs["ttft_p50_ms"] == pytest.approx(3.0)
    assert vs["peak_rss_mib"] == pytest.approx(4.0)
    assert vs["decode_tok_s_by_round"] == pytest.approx([0.5, 0.5])
    assert rep["headline"]["llama.cpp"]["vs_llama.cpp"]["decode_tok_s"] == pytest.approx(1.0)
    raw = rep["headline"]["raw"]
    assert raw["decode_tok_s"] == pytest.approx(40.0) and raw["batch_tok_s"] is None
    assert raw["vs_llama.cpp"]["batch_tok_s"] is None
    ttft = next(p for p in rep["phases"] if p["name"] == "ttft")
    assert ttft["by_target"]["ours"]["requests"] == 4 and ttft["by_target"]["ours"]["rounds"] == 2
    table = format_real_table(rep)
    assert "x llama" in table and "0.500" in table and "openblas 2t" in table
    assert "paired ratios" in table and "512-token prompts" in table
    paths = write_real_report(rep, tmp_path)
    assert [p.name for p in paths] == ["report.json", "report.txt", "report.png"]
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.loads((tmp_path / "report.json").read_text())


def test_decode_ratio_is_the_median_of_paired_rounds() -> None:
    # llama.cpp's round 2 ran in a burst of load from elsewhere (half speed)
    rep = build_real_report(_fake_runs(llama_decode=(0.01, 0.02)), phases=PHASES,
                            servers=SERVERS, meta={}, config={"rounds": 2}, skipped={})
    vs = rep["headline"]["ours"]["vs_llama.cpp"]
    assert vs["decode_tok_s_by_round"] == pytest.approx([0.5, 1.0])
    assert vs["decode_tok_s"] == pytest.approx(0.75)
    assert vs["decode_tok_s_pooled"] == pytest.approx(50.0 / 75.0)


@pytest.mark.parametrize("case", ["no-llamacpp", "nothing-ran"])
def test_report_without_llamacpp(case: str, tmp_path: Path) -> None:
    runs = [r for r in _fake_runs() if r.target != "llama.cpp"] if case == "no-llamacpp" else []
    skipped = {"llama.cpp": "llama-cpp-python is not installed; install it with: pip install x"}
    rep = build_real_report(runs, phases=PHASES, servers={}, meta={}, config={}, skipped=skipped)
    assert all("vs_llama.cpp" not in h for h in rep["headline"].values())
    table = format_real_table(rep)
    assert "skipped llama.cpp: llama-cpp-python is not installed" in table
    write_real_report(rep, tmp_path)
    assert (tmp_path / "report.png").is_file()


def test_llamacpp_is_skipped_with_a_clear_message_when_not_importable(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = _servers.importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name.split(".")[0] == "llama_cpp" else real_find_spec(name)

    monkeypatch.setattr(_servers.importlib.util, "find_spec", find_spec)
    why = _servers.llamacpp_unavailable()
    assert why is not None and "llama-cpp-python is not installed" in why
    assert "pip install 'llama-cpp-python[server]==0.3.36'" in why
    cfg = RealConfig(model=str(tmp_path / "no-model"), gguf=str(tmp_path / "x.gguf"),
                     out_dir=str(tmp_path), targets=("llamacpp",), rounds=1)
    rep = trio.run(run_real, cfg)
    assert rep["skipped"]["llama.cpp"] == why
    assert all(not p["by_target"] for p in rep["phases"])
    assert "skipped llama.cpp: llama-cpp-python is not installed" in format_real_table(rep)


def test_llamacpp_spec_queues_instead_of_interrupting() -> None:
    spec = _servers.llamacpp_spec("/m/x.gguf", 1234, threads=2, n_ctx=2048)
    argv = list(spec.argv)
    assert argv[1:3] == ["-m", "llama_cpp.server"]
    assert argv[argv.index("--interrupt_requests") + 1] == "False"
    assert argv[argv.index("--logits_all") + 1] == "False"
    assert argv[argv.index("--n_threads") + 1] == "2"
    assert spec.health_path == "/v1/models" and spec.name == "llama.cpp"


def test_chunks_count_as_tokens_for_a_server_without_usage() -> None:
    def chunk(text: str) -> str:
        return json.dumps({"choices": [{"delta": {"content": text}}]})

    for count_chunks, tokens, error in ((True, 3, None), (False, 0, "no_usage")):
        r = RequestResult(index=0)
        obs = StreamObserver(r, 0.0, count_chunks=count_chunks)
        for k, text in enumerate(["a", "b", "", "c"]):
            obs.data(chunk(text), 0.1 * (k + 1))
        obs.data("[DONE]", 0.5)
        obs.finish(0.5)
        assert (r.output_tokens, r.error) == (tokens, error)


def test_peak_rss_and_the_peer_blas_line(tmp_path: Path) -> None:
    rss = _servers.peak_rss_bytes(os.getpid())
    assert rss is not None and rss["peak"] >= rss["current"] > 0
    assert _servers.peak_rss_bytes(2**22 + 12345) is None
    log = tmp_path / "peer.log"
    log.write_text('noise\nafm-bench-blas: {"name": "openblas", "threads": 2}\nmore\n')
    assert _servers.blas_from_log(log) == {"name": "openblas", "threads": 2}
    log.write_text("no line\n")
    assert _servers.blas_from_log(log) is None


def test_calibration_and_phases() -> None:
    def count(words: int) -> float:  # ~1.3 tokens a word plus a 30-token template
        return 30 + 1.3 * words

    words = calibrate_words(count, 512)
    assert abs(count(words) - 512) <= 1.3
    cfg = RealConfig(model="/m", gguf=None, out_dir="/o", rounds=2, warmup=1)
    phases, means = make_phases(cfg, None)
    assert [p.name for p in phases] == ["decode", "batch", "ttft"] and means == {}
    assert [p.concurrency for p in phases] == [1, 8, 1]
    for p in phases:
        assert len(p.workload.jobs) == p.requests * 2 + 1
        assert p.first_index(1) == p.requests
    seeds = {p.workload.seed for p in phases}
    assert len(seeds) == 3
    assert 0 < expected_seconds(cfg, ("raw", "llamacpp")) < expected_seconds(
        cfg, ("raw", "peer", "ours", "llamacpp"))


def test_cli_refuses_targets_outside_their_mode(tmp_path: Path) -> None:
    from afm_core._cli import main

    assert main(["bench", "--real-model", "--rate", "5", "--out", str(tmp_path)]) == 2
    assert main(["bench", "--targets", "llamacpp", "--out", str(tmp_path)]) == 2


def test_real_model_mode_end_to_end_on_the_tiny_model(random_model_dir: Path, tmp_path: Path) -> None:
    """raw and afm serve on the random tiny model (llama.cpp skipped: no GGUF)."""
    from afm_core._cli import main

    out = tmp_path / "real"
    rc = main(["bench", "--real-model", "--model", str(random_model_dir), "--targets",
               "raw,ours,llamacpp", "--rounds", "1", "--decode-tokens", "6",
               "--decode-requests", "1", "--batch-requests", "8", "--batch-tokens", "4",
               "--ttft-prompt-tokens", "64", "--ttft-requests", "1", "--time-budget", "240",
               "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert "llama.cpp" in rep["skipped"]
    assert set(rep["targets"]) >= {"raw", "ours"}
    for ph in rep["phases"]:
        for t in ("raw", "ours"):
            assert ph["by_target"][t]["ok"] == ph["by_target"][t]["requests"] > 0
    ttft = next(p for p in rep["phases"] if p["name"] == "ttft")
    assert ttft["prompt_tokens_mean"] == pytest.approx(64, abs=8)
    assert rep["servers"]["ours"]["peak_rss_bytes"] > 0
    assert rep["servers"]["ours"]["blas"]["name"]
    assert (out / "report.png").is_file()
