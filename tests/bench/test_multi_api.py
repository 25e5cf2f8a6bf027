"""``afm bench --api chat,completions,...``: several wire APIs in one run.

Slot naming, the plan's job ranges (every API the same prompts), the round
order (a Williams design), the report's per-slot ratios and the API
comparison, the CLI, and one short run of raw and ``afm serve`` on the
random tiny model."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from afm_core.bench._apis import prompt_form, slot_api, slot_names, slot_target, split_target
from afm_core.bench._report import baseline, build_report, format_table, reference_slot
from afm_core.bench._results import RequestResult, RunResult
from afm_core.bench._run import BenchConfig, cpu_seconds, plan, round_order


def test_slot_names_number_repeats() -> None:
    slots = slot_names(["chat", "completions", "messages", "responses", "chat", "chat"])
    assert slots == ("chat", "completions", "messages", "responses", "chat#2", "chat#3")
    assert [slot_api(s) for s in slots] == ["chat", "completions", "messages", "responses",
                                            "chat", "chat"]
    # the raw path tokenizes completions' text as it is, every other API through the template
    assert [prompt_form(slot_api(s)) for s in slots[:4]] == ["chat", "completions", "chat", "chat"]
    assert slot_target("ours", "chat#2") == "ours[chat#2]"
    assert split_target("ours[chat#2]") == ("ours", "chat#2")
    assert split_target("raw+kernels[messages]") == ("raw+kernels", "messages")
    assert split_target("mlx_lm.server") == ("mlx_lm.server", None)
    with pytest.raises(ValueError):
        slot_names(["chat", "embeddings"])
    assert reference_slot(("messages", "chat", "chat#2")) == "chat"
    assert reference_slot(("messages", "responses")) == "messages"
    # raw runs once per prompt form: chat, messages and responses share the chat template's
    assert baseline("ours[messages]") == "raw[chat]" and baseline("ours[chat#2]") == "raw[chat]"
    assert baseline("ours[completions]") == "raw[completions]" and baseline("ours") == "raw"


def test_plan_gives_every_api_the_same_jobs() -> None:
    cfg = BenchConfig(model="/m", out_dir="/o", apis=("chat", "messages", "chat"),
                      concurrency=(1, 8), requests=4, rates=(5.0,), open_requests=3,
                      warmup=2, rounds=2)
    assert cfg.slots() == ("chat", "messages", "chat#2")
    workload, levels, warmup = plan(cfg)
    # levels and rounds on disjoint ranges, back to back: no target sees a prompt twice
    assert [(lv.level, lv.round, lv.first_index, lv.n) for lv in levels] == [
        (1.0, 0, 0, 4), (1.0, 1, 4, 4), (8.0, 0, 8, 4), (8.0, 1, 12, 4), (5.0, 0, 16, 3),
        (5.0, 1, 19, 3)]
    assert warmup.first_index == 22 and len(workload.jobs) == 24
    one = BenchConfig(model="/m", out_dir="/o", apis=("messages",), requests=4, concurrency=(1,))
    assert one.slots() == () and [lv.first_index for lv in plan(one)[1]] == [0]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_round_order_is_a_williams_design(k: int) -> None:
    """Over k rounds (2k when k is odd) every slot runs in every position
    equally often, and right after every other slot equally often."""
    n = k if k % 2 == 0 else 2 * k
    rows = [round_order(k, r) for r in range(n)]
    assert all(sorted(row) == list(range(k)) for row in rows)
    for pos in range(k):
        assert sorted(row[pos] for row in rows) == sorted(list(range(k)) * (n // k))
    pairs = [pair for row in rows for pair in itertools.pairwise(row)]
    expected = [(a, b) for a in range(k) for b in range(k) if a != b] * (n // k)
    assert sorted(pairs) == sorted(expected)
    assert round_order(k, n) == rows[0]  # and then it repeats


def test_cpu_seconds_reads_a_process() -> None:
    import os
    import sys

    own = cpu_seconds(os.getpid())
    if sys.platform != "linux":
        assert own is None
        return
    assert own is not None and own > 0
    assert cpu_seconds(2**22 + 12345) is None  # no such process


def _runs(target: str, tok_by_round: list[int], cpu: float | None = None) -> list[RunResult]:
    """One run per round, 4 requests of ``tokens`` each over 1 s; ``cpu``:
    the server's and (half of it) the client's CPU seconds per round."""
    out = []
    for r, tokens in enumerate(tok_by_round):
        reqs = [RequestResult(index=i, ttft=0.01, e2e=0.11, itls=[0.01], output_tokens=tokens)
                for i in range(4)]
        run = RunResult(target, "closed", 1.0, 1.0, reqs, server_cpu_s=cpu,
                        client_cpu_s=None if cpu is None else cpu / 2)
        run.round = r
        out.append(run)
    return out


def _report() -> dict:
    runs = (_runs("raw[chat]", [100, 100, 50]) + _runs("ours[chat]", [90, 95, 45], cpu=0.2)
            + _runs("raw[completions]", [100, 100, 100])
            + _runs("ours[completions]", [81, 95, 88], cpu=0.2)
            + _runs("ours[chat#2]", [90, 96, 45], cpu=0.21)
            + _runs("mlx_lm.server[chat]", [50, 50, 25]))
    return build_report(runs, meta={}, skipped={},
                        config={"rounds": 3, "api": "chat", "apis": ["chat", "completions", "chat"],
                                "slots": ["chat", "completions", "chat#2"]})


def test_report_sets_each_api_against_its_own_raw() -> None:
    rep = _report()
    (entry,) = rep["levels"]
    vs = entry["vs_raw"]
    assert set(vs) == {"ours[chat]", "ours[completions]", "ours[chat#2]", "mlx_lm.server[chat]"}
    assert vs["ours[chat]"]["output_tokens_per_s_by_round"] == pytest.approx([0.90, 0.95, 0.90])
    # chat#2 is set against raw[chat], the run of the same prompts through the template
    assert vs["ours[chat#2]"]["output_tokens_per_s_by_round"] == pytest.approx([0.90, 0.96, 0.90])
    assert vs["ours[completions]"]["output_tokens_per_s"] == pytest.approx(0.88)
    assert entry["ours_vs_peer_by_api"]["chat"]["output_tokens_per_s"] == pytest.approx(1.8)
    assert "ours_vs_peer" not in entry  # that key keeps its one-API meaning

    cmp = entry["api_comparison"]
    assert cmp["reference"] == "chat"
    ours = cmp["ours"]
    assert list(ours) == ["chat", "completions", "chat#2"]
    assert ours["chat"]["ratio"]["median"] == pytest.approx(0.90)
    assert (ours["chat"]["ratio"]["min"], ours["chat"]["ratio"]["max"]) == pytest.approx((0.90, 0.95))
    assert "vs_reference_pct" not in ours["chat"]
    # each round's ratio over chat's in the same round: 81/90, 95/95, 88/90
    d = ours["completions"]["vs_reference_pct"]
    assert d["by_round"] == pytest.approx([-10.0, 0.0, 100 * (88 / 90 - 1)])
    assert d["median"] == pytest.approx(100 * (88 / 90 - 1))
    assert (d["min"], d["max"]) == pytest.approx((-10.0, 0.0))
    assert d["q1"] <= d["median"] <= d["q3"]
    aa = ours["chat#2"]["vs_reference_pct"]
    assert aa["by_round"] == pytest.approx([0.0, 100 * (96 / 95 - 1), 0.0])
    # pooled: (81+95+88)/(100*3) over (90+95+45)/(100+100+50)
    pooled = ours["completions"]["pooled_ratio"]
    assert pooled == pytest.approx(264 / 300) and ours["chat"]["pooled_ratio"] == pytest.approx(0.92)
    assert ours["completions"]["pooled_vs_reference_pct"] == pytest.approx(100 * (0.88 / 0.92 - 1))
    # CPU per output token: 3 rounds of 0.2 s over 4 * (90 + 95 + 45) tokens, in ms
    assert ours["chat"]["server_cpu_ms_per_token"] == pytest.approx(600 / 920)
    assert ours["chat"]["client_cpu_ms_per_token"] == pytest.approx(300 / 920)
    assert ours["chat#2"]["server_cpu_ms_per_token_vs_reference_pct"] == pytest.approx(
        100 * ((630 / 924) / (600 / 920) - 1))
    assert cmp["mlx_lm.server"]["chat"]["server_cpu_ms_per_token"] is None
    assert cmp["mlx_lm.server"]["chat"]["ratio"]["median"] == pytest.approx(0.5)
    json.dumps(rep, allow_nan=False)


def test_table_answers_the_comparison() -> None:
    table = format_table(_report())
    assert "wire APIs chat, completions, chat#2 in one run" in table
    assert "ours[completions]" in table and "ours/peer[chat]" in table
    section = table[table.index("ours ÷ raw, tokens/s, by wire API"):]
    rows = {line.split()[1]: line.split() for line in section.splitlines()[3:6]}
    assert rows["chat"][2:4] == ["0.900", "[0.900-0.950]"] and rows["chat"][4] == "-"
    assert rows["completions"][2:7] == ["0.880", "[0.810-0.950]", "-2.2%", "[-10.0%,", "+0.0%]"]
    assert rows["chat#2"][4] == "+0.0%"
    # pooled difference, then the server's and client's CPU ms per token (and vs chat)
    assert rows["completions"][7:12] == ["-4.3%", "0.568", "(-12.9%)", "0.284", "(-12.9%)"]
    assert rows["chat"][5:7] == ["-", "0.652"]
    assert "mlx_lm.server ÷ raw" in table


def test_a_run_without_raw_compares_against_raw_with_kernels() -> None:
    """``--targets raw_kernels,ours`` (a real model, whose plain raw decodes
    at a few tokens/s): raw+kernels is every API's baseline."""
    runs = (_runs("raw+kernels[chat]", [100, 100]) + _runs("ours[chat]", [90, 95], cpu=0.2)
            + _runs("ours[messages]", [90, 90], cpu=0.2))
    rep = build_report(runs, meta={}, skipped={},
                       config={"rounds": 2, "api": "chat", "apis": ["chat", "messages"],
                               "slots": ["chat", "messages"],
                               "raw_forms": {"chat": "chat", "messages": "chat"}})
    (entry,) = rep["levels"]
    ours = entry["api_comparison"]["ours"]
    assert ours["messages"]["raw"] == "raw+kernels[chat]"
    assert ours["messages"]["ratio"]["by_round"] == pytest.approx([0.90, 0.90])
    assert ours["messages"]["vs_reference_pct"]["by_round"] == pytest.approx([0.0, 100 * (90 / 95 - 1)])
    assert "raw+kernels" not in entry["api_comparison"]  # the baseline is not compared with itself
    assert "ours ÷ raw+kernels, tokens/s, by wire API" in format_table(rep)


def test_one_api_report_has_no_comparison() -> None:
    runs = _runs("raw", [100, 100]) + _runs("ours", [90, 95])
    rep = build_report(runs, meta={}, config={"rounds": 2, "api": "messages"}, skipped={})
    (entry,) = rep["levels"]
    assert set(entry) == {"mode", "level", "label", "by_target", "vs_raw"}
    table = format_table(rep)
    assert table.startswith("served targets driven through the messages API\nlevel       target  ")
    assert "by wire API" not in table


def test_cli_takes_a_list_of_apis(tmp_path: Path) -> None:
    from afm_core._cli import main

    for bad in ("chat,embeddings", ","):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--api", bad, "--out", str(tmp_path)])
        assert exc.value.code == 2
    # the real-model comparison drives chat only, and still says so
    assert main(["bench", "--real-model", "--api", "chat,messages", "--out", str(tmp_path)]) == 2
    assert main(["bench", "--real-model", "--api", "messages", "--out", str(tmp_path)]) == 2


def entry_vs_raw_targets(rep: dict) -> dict[str, str]:
    (entry,) = rep["levels"]
    return {row["target"]: row["raw"] for row in entry["api_comparison"]["ours"].values()}


def test_completions_sends_the_chat_template_in_a_run_over_several_apis(
        random_model_dir: Path) -> None:
    """Completions sends the rendered template (and asks for no added special
    tokens), so its prompt tokens are the chat APIs' own."""
    import mlx_lm

    from afm_core.bench._apis import body
    from afm_core.bench._run import _chat_renderer
    from afm_core.bench._workload import make_workload, templated

    plain = make_workload(1, 3)
    work = templated(plain, _chat_renderer(str(random_model_dir)))
    _, tok = mlx_lm.load(str(random_model_dir))
    for job, was in zip(work.jobs, plain.jobs, strict=True):
        b = body(job, "completions", model=None)
        assert b["add_special_tokens"] is False and "add_special_tokens" not in body(was, "completions", model=None)
        assert b["prompt"].startswith("<|im_start|>user\n") and b["prompt"].endswith("assistant\n")
        chat_ids = tok.apply_chat_template([dict(m) for m in job.messages],
                                           add_generation_prompt=True, tokenize=True)
        assert list(tok.encode(b["prompt"], add_special_tokens=False)) == list(chat_ids)
        assert body(job, "chat", model=None) == body(was, "chat", model=None)


def _short_run(model: Path, out: Path, *, targets: str, apis: str, concurrency: int,
               requests: int) -> dict:
    """A two-round ``afm bench`` over several APIs on the tiny model: its report."""
    from afm_core._cli import main

    rc = main(["bench", "--model", str(model), "--targets", targets, "--api", apis,
               "--rounds", "2", "--concurrency", str(concurrency), "--requests", str(requests),
               "--max-tokens", "4", "--prompt-words", "8:16", "--warmup", "1",
               "--request-timeout", "20", "--level-timeout", "30", "--time-budget", "90",
               "--out", str(out)])
    assert rc == 0
    return json.loads((out / "report.json").read_text())


def test_several_apis_in_one_run(random_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    rep = _short_run(random_model_dir, out, targets="raw,ours", apis="chat,completions,chat",
                     concurrency=2, requests=3)
    assert rep["config"]["interleave"] is True  # implied
    assert rep["config"]["slots"] == ["chat", "completions", "chat#2"]
    # one raw target (completions sends the template's text), then the served slots
    assert rep["targets"] == ["raw[chat]", "ours[chat]", "ours[completions]", "ours[chat#2]"]
    assert rep["config"]["raw_forms"] == {"chat": "chat", "completions": "chat", "chat#2": "chat"}
    assert entry_vs_raw_targets(rep) == {"ours[chat]": "raw[chat]", "ours[completions]": "raw[chat]",
                                         "ours[chat#2]": "raw[chat]"}
    (entry,) = rep["levels"]
    for name in rep["targets"]:
        s = entry["by_target"][name]
        assert s["requests"] == 6 and s["ok"] == 6 and s["errors"] == {}, (name, s)
        if name.startswith("ours") and sys.platform == "linux":
            assert s["server_cpu_s"] > 0 and s["server_cpu_ms_per_token"] > 0, s
    # every API ran the same prompts, so the server ran with its prefix cache off
    argv = rep["meta"]["servers"]["ours"]
    assert argv[argv.index("--prefix-cache-bytes") + 1] == "0"
    assert set(entry["api_comparison"]["ours"]) == {"chat", "completions", "chat#2"}
    assert len(entry["api_comparison"]["ours"]["chat#2"]["vs_reference_pct"]["by_round"]) == 2
    # one server for every API, and every API's prompts counted as raw counted them
    assert len(list((out / "logs").glob("ours-*.log"))) == 1
    checks = rep["checks"]["prompt_tokens_vs_raw"]
    assert set(checks) == {"ours[chat]", "ours[completions]", "ours[chat#2]"}
    assert all(c["checked"] == 6 and c["mismatched"] == 0 for c in checks.values()), checks
    assert "ours ÷ raw, tokens/s, by wire API" in (out / "report.txt").read_text()


def test_multi_round_balances_what_runs_after_a_served_level() -> None:
    """Raw targets come first on even rounds and last on odd ones, rotated
    every two rounds: each is the first after the served slots equally often."""
    from afm_core.bench._run import multi_round

    raws, served = ["r0", "r1"], [["s0"], ["s1", "p1"], ["s2"]]
    rounds = [multi_round(raws, served, r) for r in range(12)]
    assert rounds[0] == ["r0", "r1", "s0", "s1", "p1", "s2"]  # round_order(3, 0) == [0, 1, 2]
    assert rounds[1] == ["s1", "p1", "s2", "s0", "r0", "r1"]
    assert rounds[2][:2] == ["r1", "r0"] and rounds[3][-2:] == ["r1", "r0"]
    after_served = [b for row in rounds for a, b in itertools.pairwise(row)
                    if b.startswith("r") and not a.startswith("r")]
    assert sorted(after_served) == ["r0", "r0", "r0", "r1", "r1", "r1"]
    assert all(sorted(row) == sorted([*raws, "s0", "s1", "p1", "s2"]) for row in rounds)
    assert multi_round([], served, 1) == ["s1", "p1", "s2", "s0"]


def test_several_apis_against_raw_with_kernels(random_model_dir: Path, tmp_path: Path) -> None:
    """Without plain raw, raw+kernels is the baseline and the prompt-token
    check still runs (raw+kernels tokenizes as raw does)."""
    rep = _short_run(random_model_dir, tmp_path / "bench", targets="raw_kernels,ours",
                     apis="chat,messages", concurrency=1, requests=2)
    assert rep["targets"][0] == "raw+kernels[chat]"
    assert entry_vs_raw_targets(rep) == {"ours[chat]": "raw+kernels[chat]",
                                         "ours[messages]": "raw+kernels[chat]"}
    checks = rep["checks"]["prompt_tokens_vs_raw"]
    assert set(checks) == {"ours[chat]", "ours[messages]"}
    assert all(c["checked"] == 4 and c["mismatched"] == 0 for c in checks.values()), checks
