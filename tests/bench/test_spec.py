"""Tests for ``afm bench --speculation``: the bytes-per-token arithmetic, the
counters read from afm's ``/metrics`` and llama.cpp's timings, the report's
bookkeeping (ratios from the right targets, same-text checks), and a short
run on the random tiny model drafting for itself (llama.cpp skipped: no
GGUF).  No timing is asserted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from afm_core.bench._results import RequestResult, RunResult
from afm_core.bench._spec import SPEC_TARGETS, bytes_per_token, parse_spec_metrics
from afm_core.bench._spec_prompts import CODE_EDIT, workloads
from afm_core.bench._spec_report import build_spec_report, format_spec_table, same_text


def test_bytes_per_token() -> None:
    # plain decoding: one read of the model per token
    assert bytes_per_token(decoded=100, proposed=0, accepted=0, model_bytes=10) == 10
    # lookup: 60 of 100 tokens came from 40 verify steps (+ nothing read to draft)
    assert bytes_per_token(decoded=100, proposed=80, accepted=60, model_bytes=10) == pytest.approx(4.0)
    # a draft of 4 bytes: 80 draft reads pay back only when accepted / proposed > 4 / 10
    assert bytes_per_token(decoded=100, proposed=80, accepted=60, model_bytes=10,
                           draft_bytes=4) == pytest.approx((80 * 4 + 40 * 10) / 100)
    assert bytes_per_token(decoded=100, proposed=80, accepted=32, model_bytes=10,
                           draft_bytes=4) == pytest.approx(10.0)  # exactly the break-even
    assert bytes_per_token(decoded=0, proposed=0, accepted=0, model_bytes=10) is None


def test_metrics_counters_are_summed_over_models() -> None:
    text = "\n".join([
        "# HELP afm_spec_steps_total Speculative decoding verify steps",
        "# TYPE afm_spec_steps_total counter",
        'afm_spec_steps_total{model="a"} 3',
        'afm_spec_steps_total{model="b"} 2',
        'afm_spec_proposed_tokens_total{model="a"} 12',
        'afm_spec_accepted_tokens_total{model="a"} 7.0',
        'afm_requests_total{model="a"} 99',
        "garbage line",
    ])
    assert parse_spec_metrics(text) == {"steps": 5.0, "proposed": 12.0, "accepted": 7.0}


def test_workloads_are_fixed_and_distinct() -> None:
    wl = workloads(5, 64)
    assert set(wl) == {"chat", "code_edit"}
    assert len(wl["chat"].jobs) == 5 and wl["code_edit"].jobs[0].max_tokens == 64
    first = wl["code_edit"].jobs[0].messages[0]["content"]
    code, old, new = CODE_EDIT[0]
    assert code in first and f"`{old}` to `{new}`" in first
    assert workloads(5, 64)["chat"].jobs == wl["chat"].jobs


def _run(target: str, wl: str, rnd: int, *, tpot: float, texts: list[str], tokens: int = 21,
         timings: dict[str, int] | None = None) -> RunResult:
    reqs = [RequestResult(index=rnd * len(texts) + i, ttft=0.5, e2e=0.5 + tpot * (tokens - 1),
                          output_tokens=tokens, text=t, timings=timings) for i, t in enumerate(texts)]
    run = RunResult(target, wl, 1.0, 1.0, reqs)
    run.round = rnd
    return run


def test_report_bookkeeping() -> None:
    runs, counters = [], {}
    for rnd in (0, 1):
        runs.append(_run("ours", "code_edit", rnd, tpot=0.1, texts=["a", "b"]))  # 10 tok/s
        runs.append(_run("ours+lookup", "code_edit", rnd, tpot=0.05, texts=["a", "b"]))  # 20
        runs.append(_run("ours+draft", "code_edit", rnd, tpot=0.08, texts=["a", "x"]))
        runs.append(_run("llama.cpp", "code_edit", rnd, tpot=0.0625, texts=["a", "b"]))  # 16
        runs.append(_run("llama.cpp+draft", "code_edit", rnd, tpot=0.05, texts=["a", "b"],
                         timings={"draft_n": 10, "draft_n_accepted": 5}))
        counters[("ours+lookup", "code_edit", rnd)] = {"steps": 10.0, "proposed": 30.0, "accepted": 20.0}
        counters[("ours+draft", "code_edit", rnd)] = {"steps": 10.0, "proposed": 40.0, "accepted": 10.0}
        counters[("llama.cpp+draft", "code_edit", rnd)] = {"proposed": 20.0, "accepted": 10.0}
    rep = build_spec_report(runs, counters, model={"name": "m", "weight_bytes": 1000},
                            draft={"name": "d", "weight_bytes": 400}, servers={}, skipped={},
                            meta={}, config={"rounds": 2}, workloads={})
    t = rep["table"]["code_edit"]
    assert t["ours"]["decode_tok_s"] == pytest.approx(10.0)
    assert t["ours+lookup"]["vs_ours"] == pytest.approx(2.0)
    assert t["ours+lookup"]["vs_llama.cpp"] == pytest.approx(1.25)
    assert t["ours+lookup"]["acceptance"] == pytest.approx(2 / 3)
    assert t["ours+lookup"]["proposed_per_step"] == pytest.approx(3.0)
    decoded = 2 * 2 * 20  # 2 rounds x 2 requests x (21 - 1) tokens
    assert t["ours+lookup"]["decoded_tokens"] == decoded
    assert t["ours+lookup"]["bytes_per_token"] == pytest.approx((decoded - 40) * 1000 / decoded)
    assert t["ours+draft"]["bytes_per_token"] == pytest.approx((80 * 400 + (decoded - 20) * 1000) / decoded)
    assert t["ours+draft"]["break_even_acceptance"] == pytest.approx(0.4)
    assert "break_even_acceptance" not in t["ours+lookup"]
    assert t["ours"]["bytes_per_token"] == pytest.approx(1000.0)  # plain: the model once a token
    assert t["ours+lookup"]["same_text"] == {"compared": 4, "differ": 0, "same": True}
    assert t["ours+draft"]["same_text"] == {"compared": 4, "differ": 2, "same": False}
    assert t["llama.cpp+draft"]["same_text_as"] == "llama.cpp"
    assert t["llama.cpp+draft"]["acceptance"] == pytest.approx(0.5)
    assert "same_text" not in t["ours"]
    assert rep["ours_vs_llamacpp_text"]["code_edit"]["same"]
    table = format_spec_table(rep)
    assert "NO 2/4" in table and "yes" in table and "40%" in table
    assert same_text({}, {}) == {"compared": 0, "differ": 0, "same": False}


def test_speculation_end_to_end_on_the_tiny_model(random_model_dir: Path, tmp_path: Path) -> None:
    from afm_core._cli import main

    draft = tmp_path / "draft"
    shutil.copytree(random_model_dir, draft)  # the model drafting for itself: same tokenizer
    out = tmp_path / "spec"
    rc = main(["bench", "--speculation", "--spec-model", str(random_model_dir), "--spec-draft",
               str(draft), "--targets", ",".join(SPEC_TARGETS), "--rounds", "2",
               "--spec-max-tokens", "24", "--spec-requests", "1", "--out", str(out)])
    assert rc == 0
    rep: dict[str, Any] = json.loads((out / "report.json").read_text())
    assert "no GGUF file" in rep["skipped"]["llama.cpp"]
    assert "llama.cpp+draft" in rep["skipped"]
    assert rep["targets"] == ["ours", "ours+lookup", "ours+draft"]
    for wl in ("chat", "code_edit"):
        rows = rep["table"][wl]
        assert rows["ours"]["requests"] == 2 and rows["ours"]["proposed"] == 0
        for name in ("ours+lookup", "ours+draft"):
            row = rows[name]
            assert row["requests"] == 2 and row["same_text_as"] == "ours"
            assert row["same_text"]["same"], (wl, name)  # greedy speculation: the same tokens
            assert 0 <= row["accepted"] <= row["proposed"]
            assert row["bytes_per_token"] is not None
        assert rows["ours+draft"]["proposed"] > 0  # the draft proposes at every step
    for name in rep["targets"]:
        assert rep["servers"][name]["peak_rss_bytes"] > 0
    assert "MB/token" in (out / "report.txt").read_text()
