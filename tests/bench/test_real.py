"""Tests for ``afm bench --real-model``: the report's bookkeeping (which
figure each ratio comes from and which way it points, paired rounds, the
columns a model's phases give), the phases planned for a model's context,
the targets chosen and skipped, and short runs on the random tiny model.
Nothing here needs a real model or llama.cpp (``test_real_llamacpp.py``
runs llama.cpp where it is installed); no timing is ever asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from afm_core.bench import _llamacpp, _real_targets
from afm_core.bench._real import RealConfig, _n_ctx, expected_seconds, select_targets
from afm_core.bench._real_models import ModelSpec
from afm_core.bench._real_phases import length_label, plan_phases
from afm_core.bench._real_report import (
    build_model_report,
    columns_for,
    decode_rates,
    format_real_table,
    write_real_report,
)
from afm_core.bench._real_targets import TargetContext
from afm_core.bench._results import RequestResult, RunResult

PHASES: list[dict[str, Any]] = [
    {"name": "decode", "kind": "decode", "title": "1 stream"},
    {"name": "batch", "kind": "batch", "title": "8 streams"},
    {"name": "ttft_512", "kind": "ttft", "title": "512", "prompt_tokens_mean": 509.0,
     "prompt_tokens_target": 512, "prompt_tokens_requested": 512},
    {"name": "ttft_16k", "kind": "ttft", "title": "capped", "prompt_tokens_mean": 8150.0,
     "prompt_tokens_target": 8168, "prompt_tokens_requested": 16384},
]


def _fake(target: str, phase: str, rnd: int, *, tpot: float, ttft: float, tokens: int = 33,
          n: int = 2, duration: float | None = None, prompt: int = 100) -> RunResult:
    """``n`` requests of ``tokens`` tokens, ``tpot`` s per token after the first."""
    reqs = [RequestResult(index=i, ttft=ttft, e2e=ttft + tpot * (tokens - 1), prompt_tokens=prompt,
                          itls=[tpot] * (tokens - 1), output_tokens=tokens) for i in range(n)]
    dur = duration if duration is not None else n * (ttft + tpot * (tokens - 1))
    run = RunResult(target, phase, 1.0, dur, reqs)
    run.round = rnd
    return run


def _fake_runs(llama_decode: tuple[float, float] = (0.01, 0.01)) -> list[RunResult]:
    runs = []
    for rnd in (0, 1):
        # llama.cpp: 100 tok/s decode, 200 tok/s at 8 streams, 100 ms and 4 s TTFT
        runs.append(_fake("llama.cpp", "decode", rnd, tpot=llama_decode[rnd], ttft=0.01))
        runs.append(_fake("llama.cpp", "batch", rnd, tpot=0.01, ttft=0.01, n=8, duration=8 * 33 / 200))
        runs.append(_fake("llama.cpp", "ttft_512", rnd, tpot=0.01, ttft=0.100, tokens=8))
        runs.append(_fake("llama.cpp", "ttft_16k", rnd, tpot=0.01, ttft=4.0, tokens=8))
        # ours: 50 tok/s decode, 400 tok/s at 8 streams, 300 ms and 2 s TTFT
        runs.append(_fake("ours", "decode", rnd, tpot=0.02, ttft=0.01))
        runs.append(_fake("ours", "batch", rnd, tpot=0.02, ttft=0.02, n=8, duration=8 * 33 / 400))
        runs.append(_fake("ours", "ttft_512", rnd, tpot=0.02, ttft=0.300, tokens=8))
        runs.append(_fake("ours", "ttft_16k", rnd, tpot=0.02, ttft=2.0, tokens=8))
        runs.append(_fake("raw", "decode", rnd, tpot=0.025, ttft=0.01))
    return runs


SERVERS = {"llama.cpp": {"peak_rss_bytes": 200 * 2**20, "isa": "avx2", "blas": {"name": "ggml"},
                         "threads": 2},
           "ours": {"peak_rss_bytes": 300 * 2**20, "isa": "avx512-vnni", "threads": 2,
                    "blas": {"name": "openblas", "threads": 2, "verified": True}},
           "raw": {"peak_rss_bytes": 1000 * 2**20}}
SPEC = {"name": "tiny-gguf", "gguf": "/m/tiny.gguf", "architecture": "llama", "context": 8192,
        "api": "chat", "weight_bytes": 90_000_000}


def _report(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"spec": SPEC, "phases": PHASES, "servers": SERVERS, "skipped": {}}
    args.update(kw)
    runs = args.pop("runs", None)
    return build_model_report(_fake_runs() if runs is None else runs, **args)


def test_decode_rate_leaves_the_prefill_out() -> None:
    run = _fake("x", "decode", 0, tpot=0.02, ttft=5.0, tokens=11)
    assert decode_rates(run) == pytest.approx([50.0, 50.0])
    run.requests.append(RequestResult(index=9, error="connect"))
    run.requests.append(RequestResult(index=10, ttft=0.1, e2e=0.1, output_tokens=1))
    assert len(decode_rates(run)) == 2


def test_columns_follow_the_phases() -> None:
    cols = columns_for(PHASES)
    assert [c["key"] for c in cols] == ["decode_tok_s", "batch_tok_s", "ttft_512_ms", "ttft_16k_ms",
                                        "peak_rss_mib"]
    titles = {c["key"]: c["title"] for c in cols}
    assert titles["ttft_512_ms"] == "TTFT 512"  # not capped: no length in the title
    assert titles["ttft_16k_ms"] == "TTFT 16k (8150)"  # capped to the context: its real length


def test_every_ratio_points_up_when_better_except_rss() -> None:
    rep = _report()
    assert rep["targets"] == ["llama.cpp", "ours", "raw"]
    ours = rep["headline"]["ours"]
    assert ours["decode_tok_s"] == pytest.approx(50.0)
    assert ours["batch_tok_s"] == pytest.approx(400.0)
    assert ours["ttft_512_ms"] == pytest.approx(300.0)
    assert ours["ttft_16k_ms"] == pytest.approx(2000.0)
    assert ours["peak_rss_mib"] == pytest.approx(300.0)
    vs = ours["vs_llama.cpp"]
    assert vs["decode_tok_s"] == pytest.approx(0.5)  # slower decode: below 1
    assert vs["batch_tok_s"] == pytest.approx(2.0)
    assert vs["ttft_512_ms"] == pytest.approx(100 / 300)  # slower first token: below 1
    assert vs["ttft_16k_ms"] == pytest.approx(2.0)  # faster first token: above 1
    assert vs["peak_rss_mib"] == pytest.approx(1.5)  # RSS stays this / llama.cpp
    assert vs["decode_tok_s_by_round"] == pytest.approx([0.5, 0.5])
    assert rep["headline"]["llama.cpp"]["vs_llama.cpp"]["decode_tok_s"] == pytest.approx(1.0)
    raw = rep["headline"]["raw"]
    assert raw["decode_tok_s"] == pytest.approx(40.0) and raw["batch_tok_s"] is None
    assert raw["vs_llama.cpp"]["batch_tok_s"] is None and raw["vs_llama.cpp"]["ttft_512_ms"] is None


def test_speed_ratios_are_medians_of_paired_rounds() -> None:
    # llama.cpp's round 2 ran in a burst of load from elsewhere (half speed)
    rep = _report(runs=_fake_runs(llama_decode=(0.01, 0.02)))
    vs = rep["headline"]["ours"]["vs_llama.cpp"]
    assert vs["decode_tok_s_by_round"] == pytest.approx([0.5, 1.0])
    assert vs["decode_tok_s"] == pytest.approx(0.75)
    assert vs["decode_tok_s_pooled"] == pytest.approx(50.0 / 75.0)


def test_phase_details_count_prompts_and_flag_a_mismatch() -> None:
    runs = _fake_runs()
    for run in runs:
        if run.target == "ours" and run.mode == "ttft_512":
            for q in run.requests:
                q.prompt_tokens = 140
    rep = _report(runs=runs)
    ph = next(p for p in rep["phases"] if p["name"] == "ttft_512")
    assert ph["by_target"]["ours"]["requests"] == 4 and ph["by_target"]["ours"]["rounds"] == 2
    assert ph["by_target"]["llama.cpp"]["prompt_tokens_mean"] == 100
    assert any("ttft_512" in n and "different prompt lengths" in n for n in rep["notes"])
    assert not any("decode:" in n for n in rep["notes"])


def test_table_and_files(tmp_path: Path) -> None:
    model = _report(skipped={"ours-avx2": "this CPU's best kernels are avx2 already"})
    rep = {"mode": "real-model", "baseline": "llama.cpp", "models": [model],
           "missing": {"gemma-3-270m": "not found in /nowhere"},
           "meta": {"cpu_count": 2, "loadavg_start": [1.0], "loadavg_end": [2.0],
                    "env": {"OPENBLAS_CORETYPE": "Haswell"}},
           "config": {"rounds": 2}}
    table = format_real_table(rep)
    assert "== tiny-gguf: tiny.gguf, llama, context 8192" in table
    assert "0.50x" in table and "2.00x" in table and "1.50x" in table
    assert "avx512-vnni / openblas 2t / 2" in table and "avx2 / ggml / 2" in table
    assert "skipped ours-avx2: this CPU's best kernels are avx2 already" in table
    assert "model gemma-3-270m not run: not found in /nowhere" in table
    assert "paired ratios" in table and "environment OPENBLAS_CORETYPE=Haswell" in table
    paths = write_real_report(rep, tmp_path)
    assert [p.name for p in paths] == ["report.json", "report.txt", "report.png"]
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.loads((tmp_path / "report.json").read_text())


def test_report_without_llamacpp_has_no_ratios(tmp_path: Path) -> None:
    runs = [r for r in _fake_runs() if r.target != "llama.cpp"]
    model = _report(runs=runs, servers={}, skipped={"llama.cpp": "xllamacpp is not installed"})
    assert all("vs_llama.cpp" not in h for h in model["headline"].values())
    rep = {"models": [model], "meta": {}, "config": {}}
    assert "skipped llama.cpp: xllamacpp is not installed" in format_real_table(rep)
    write_real_report(rep, tmp_path)  # a plot without any ratio


def test_phases_are_capped_to_the_context_and_run_once() -> None:
    cfg = RealConfig(out_dir="/o", ttft_lengths=(512, 4096, 16384), ttft_max_tokens=8)
    plans = plan_phases(cfg, 8192)
    ttft = [p for p in plans if p.kind == "ttft"]
    assert [p.name for p in ttft] == ["ttft_512", "ttft_4k", "ttft_16k"]
    assert [p.prompt_tokens for p in ttft] == [512, 4096, 8192 - 8 - 16]
    assert [p.warm for p in ttft] == [True, False, False]  # only the shortest is warmed up
    small = plan_phases(cfg, 4096)  # 4k and 16k both capped to the same length: one phase
    assert [p.name for p in small if p.kind == "ttft"] == ["ttft_512", "ttft_4k"]
    assert [p.concurrency for p in plans[:2]] == [1, 8]
    assert [length_label(n) for n in (512, 4096, 16384, 1500)] == ["512", "4k", "16k", "1500"]
    spec = ModelSpec(name="m", gguf=None, context=8192, weight_bytes=90_000_000)
    assert _n_ctx(cfg, spec, plans) == 8192  # the longest prompt and its tokens, within the context
    assert _n_ctx(cfg, ModelSpec(name="m", gguf=None), plan_phases(cfg, None)) >= 16384 + 128
    assert 0 < expected_seconds(cfg, spec, plans, 1) < expected_seconds(cfg, spec, plans, 3)


def _ctx(tmp_path: Path) -> TargetContext:
    return TargetContext(log_dir=tmp_path, threads=2)


def test_targets_skip_with_their_reasons(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = _llamacpp.importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name.split(".")[0] in ("xllamacpp", "llama_cpp") else real_find_spec(name)

    monkeypatch.setattr(_llamacpp.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(_real_targets, "_afm_isa_best", lambda: "avx2")
    cfg = RealConfig(out_dir=str(tmp_path), targets=("ours", "ours_avx2", "llamacpp", "llamacpp_py",
                                                     "raw"))
    spec = ModelSpec(name="qwen", gguf=str(tmp_path / "q.gguf"),
                     afm_error="afm cannot load it yet: unsupported GGUF architecture 'qwen2'")
    names, skipped = select_targets(cfg, spec, _ctx(tmp_path))
    assert names == []
    assert skipped["ours"].startswith("afm cannot load it yet") and skipped["raw"] == skipped["ours"]
    assert "pip install 'xllamacpp==" in skipped["llama.cpp"]
    assert "llama-cpp-python is not installed" in skipped["llama-cpp-python"]
    ok = ModelSpec(name="smol", gguf=None, directory=str(tmp_path))
    names, skipped = select_targets(cfg, ok, _ctx(tmp_path))
    assert names == ["ours", "raw"]
    assert "best kernels are avx2 already" in skipped["ours-avx2"]
    assert "no GGUF file" in skipped["llama.cpp"]


def test_afm_targets_are_launched_alike_but_for_the_kernels(tmp_path: Path) -> None:
    spec = ModelSpec(name="m", gguf="/m/x.gguf", afm_model="/m/x.gguf", directory="/d")
    ctx = TargetContext(log_dir=tmp_path, threads=3, threads_explicit=True, max_batch=8)
    ours = _real_targets._spec_for("ours", spec, ctx, 1234, "ours", ())
    avx2 = _real_targets._spec_for("ours_avx2", spec, ctx, 1234, "ours-avx2", ())
    assert ours.argv == avx2.argv
    argv = list(ours.argv)
    assert argv[argv.index("--prefix-cache-bytes") + 1] == "0"
    assert argv[argv.index("--prompt-lookup") + 1] == "0"  # plain decoding (--speculation measures lookup)
    assert argv[argv.index("--max-batch") + 1] == "8" and argv[argv.index("--model") + 1] == "/m/x.gguf"
    assert dict(ours.env) == {"AFM_BLAS_THREADS": "3", "AFM_QMM_THREADS": "3"}
    assert dict(avx2.env) == {"AFM_BLAS_THREADS": "3", "AFM_QMM_THREADS": "3",
                              "AFM_QMM_ISA": "avx2", "OPENBLAS_CORETYPE": "Haswell"}
    default = _real_targets._spec_for("ours", ModelSpec(name="d", gguf="/g"), ctx, 1, "ours", ())
    assert "--model" not in default.argv  # the default model: afm serve without --model


def test_llamacpp_runs_its_batching_server_with_caches_off(tmp_path: Path) -> None:
    spec = ModelSpec(name="m", gguf="/m/x.gguf")
    ctx = TargetContext(log_dir=tmp_path, threads=2, max_batch=8, n_ctx=16640,
                        llamacpp_settings=("flash_attn_type=DISABLED",))
    server = _real_targets._spec_for("llamacpp", spec, ctx, 4321, "llama.cpp", ())
    argv = list(server.argv)
    assert argv[1].endswith("_llamacpp_launcher.py")
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    for item in ("n_parallel=8", "kv_unified=true", "n_ctx=16640", "cpuparams.n_threads=2",
                 "cpuparams_batch.n_threads=2", "cache_ram_mib=0", "cache_idle_slots=false"):
        assert item in sets
    assert sets[-1] == "flash_attn_type=DISABLED"  # the user's settings come last
    assert server.health_path == "/health" and server.name == "llama.cpp"
    assert _llamacpp.REQUEST_EXTRA == {"cache_prompt": False}
    serial = _real_targets._spec_for("llamacpp_py", spec, ctx, 4321, "llama-cpp-python", ())
    args = list(serial.argv)
    assert args[1:3] == ["-m", "llama_cpp.server"]
    assert args[args.index("--interrupt_requests") + 1] == "False"
    assert args[args.index("--n_ctx") + 1] == "16640"
    assert "llamacpp_py" in _real_targets.SERIAL_KEYS


def test_cli_refuses_what_the_modes_do_not_take(tmp_path: Path) -> None:
    from afm_core._cli import main

    assert main(["bench", "--real-model", "--rate", "5", "--out", str(tmp_path)]) == 2
    assert main(["bench", "--targets", "llamacpp", "--out", str(tmp_path)]) == 2
    assert main(["bench", "--real-model", "--targets", "ours_lookup", "--out", str(tmp_path)]) == 2
    assert main(["bench", "--real-model", "--speculation", "--out", str(tmp_path)]) == 2


def _run(args: list[str], out: Path) -> dict[str, Any]:
    from afm_core._cli import main

    assert main(["bench", "--real-model", *args, "--out", str(out)]) == 0
    rep: dict[str, Any] = json.loads((out / "report.json").read_text())
    return rep


def test_end_to_end_on_the_tiny_model(random_model_dir: Path, tmp_path: Path) -> None:
    """raw and afm serve on the random tiny model, two interleaved rounds
    (llama.cpp skipped: no GGUF); the layout, never the numbers."""
    rep = _run(["--model", str(random_model_dir), "--targets", "ours,raw,llamacpp", "--rounds", "2",
                "--decode-tokens", "6", "--decode-requests", "1", "--batch-requests", "8",
                "--batch-tokens", "4", "--ttft-lengths", "300,100000", "--ttft-requests", "1",
                "--time-budget", "600", "--competing-load", "1"], tmp_path / "real")
    assert len(rep["models"]) == 1 and isinstance(rep["meta"]["env"], dict)
    m = rep["models"][0]
    assert m["competing_load"] == 1
    assert "no GGUF file" in m["skipped"]["llama.cpp"]
    assert m["targets"] == ["ours", "raw"]
    names = [ph["name"] for ph in m["phases"]]
    assert names == ["decode", "batch", "ttft_300", "ttft_100000"]
    for ph in m["phases"]:
        for t in ("raw", "ours"):
            assert ph["by_target"][t]["ok"] == ph["by_target"][t]["requests"] > 0
    by_name = {ph["name"]: ph for ph in m["phases"]}
    # prompts fitted with the model's tokenizer, the long one capped to its context
    assert 280 <= by_name["ttft_300"]["prompt_tokens_mean"] <= 300
    cap = m["model"]["context"] - 8 - 16
    assert cap - 40 <= by_name["ttft_100000"]["prompt_tokens_mean"] <= cap
    # a prompt of its own for every round and the warm-up
    assert len(set(by_name["ttft_300"]["prompt_digests"])) == 3
    # the served target saw the very prompts counted
    assert by_name["ttft_300"]["by_target"]["ours"]["prompt_tokens_mean"] == pytest.approx(
        by_name["ttft_300"]["prompt_tokens_mean"], abs=1)
    # interleaved: every phase on every target in round 1, the order reversed in round 2
    seq = [tuple(s) for s in m["sequence"]]
    assert seq[:2] == [(0, "decode", "ours"), (0, "decode", "raw")]
    assert (1, "decode", "raw") in seq and seq.index((1, "decode", "raw")) < seq.index((1, "decode", "ours"))
    assert len(seq) == 2 * 4 * 2
    for t in ("ours", "raw"):
        assert m["servers"][t]["peak_rss_bytes"] > 0 and m["headline"][t]["peak_rss_mib"] > 0
        assert m["servers"][t]["blas"]["name"]
    assert "ISA / BLAS / threads" in (tmp_path / "real" / "report.txt").read_text()
    assert "under a competing load: 1 process spinning" in (tmp_path / "real" / "report.txt").read_text()
    assert (tmp_path / "real" / "report.png").is_file()


def test_a_model_that_cannot_be_found_is_reported(tmp_path: Path) -> None:
    from afm_core._cli import main

    out = tmp_path / "missing"
    rc = main(["bench", "--real-model", "--models", str(tmp_path / "nope.gguf"), "--out", str(out)])
    assert rc == 1  # nothing ran
    rep = json.loads((out / "report.json").read_text())
    assert rep["models"] == [] and "neither a model name" in rep["missing"][str(tmp_path / "nope.gguf")]


def test_sigterm_stops_the_servers_and_keeps_what_ran(random_model_dir: Path, tmp_path: Path) -> None:
    """A run stopped by SIGTERM (a batch job's end) writes the report of the
    levels that ran and stops the servers it started."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, "-m", "afm_core._cli", "bench", "--real-model", "--model", str(random_model_dir),
         "--targets", "ours", "--rounds", "200", "--decode-tokens", "4", "--decode-requests", "1",
         "--batch-requests", "8", "--batch-tokens", "2", "--ttft-lengths", "200", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # until the first level has run
            if "round 1/200 decode ours" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    m = json.loads((out / "report.json").read_text())["models"][0]
    assert m["skipped"]["stopped"] == "stopped by SIGTERM"
    assert m["sequence"] and m["sequence"][0] == [0, "decode", "ours"]
    assert m["phases"][0]["by_target"]["ours"]["ok"] >= 1
    pid = m["servers"]["ours"]["pid"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # gone, or a zombie its dead parent left to init
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.2)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("afm serve outlived the stopped run")


def test_speculation_s_lookup_target_is_the_server_s_automatic_setting_unless_given(tmp_path: Path) -> None:
    """``--speculation``'s ``ours+lookup`` runs ``afm serve --prompt-lookup
    auto`` (what users get: 4 tokens with the VNNI kernels, 2 with the
    others) unless ``--spec-lookup N`` asks for N; plain ``ours`` never
    speculates."""
    from afm_core.bench._spec import SpecConfig, _plan

    model = ModelSpec(name="m", gguf="/m/x.gguf", afm_model="/m/x.gguf", directory="/d")
    ctx = TargetContext(log_dir=tmp_path, threads=2, threads_explicit=False, max_batch=1)

    def extra(**config: Any) -> dict[str, tuple[str, ...]]:
        cfg = SpecConfig(out_dir=str(tmp_path), targets=("ours", "ours_lookup"), **config)
        plans, skipped = _plan(cfg, model, model, ctx)
        assert not skipped
        return {name: args for _, name, args in plans}

    auto = extra()
    assert auto["ours+lookup"] == ("--prompt-lookup", "auto", "--spec-max-batch", "1")
    assert auto["ours"] == ("--spec-max-batch", "0")
    assert extra(lookup=2)["ours+lookup"] == ("--prompt-lookup", "2", "--spec-max-batch", "1")
