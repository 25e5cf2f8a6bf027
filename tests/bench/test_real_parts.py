"""The parts under ``afm bench --real-model``: the long prompts and their
calibration, the model specs read from GGUF files, the llama.cpp launcher's
settings and log line, and the load generator's per-target body fields and
kept text.  No llama.cpp needed."""

from __future__ import annotations

import enum
import json
import types
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from afm_core.bench import _llamacpp, _llamacpp_launcher, _prompts, _real_models
from afm_core.bench._http import read_request
from afm_core.bench._loadgen import Target, run_closed
from afm_core.bench._workload import make_workload
from tests.models import gguf_writer as gw


def _count_chars(per_token: float = 3.5) -> _prompts.Counter:
    async def count(messages: _prompts.Messages) -> int:
        return round(sum(len(m["content"]) + 8 for m in messages) / per_token)

    return count


@pytest.mark.parametrize("target", [600, 2048, 5000, 16384])
async def test_prompts_fit_their_length(target: int) -> None:
    count = _count_chars()
    msgs, n = await _prompts.calibrated_messages(count, 3, target, seed=7)
    assert n == await count(msgs)
    assert target - 2 <= n <= target  # lines, then characters of the next one
    system, user = msgs[0]["content"], msgs[1]["content"]
    assert system.splitlines()[0] == "session 7-3"
    assert ("# Tools" in system) == (target >= _prompts.AGENT_THRESHOLD)
    assert user.rstrip().endswith(_prompts.TASK)
    assert user.count("<file path=") == user.count("</file>") >= 1


async def test_prompts_differ_from_their_first_line() -> None:
    count = _count_chars()
    a, _ = await _prompts.calibrated_messages(count, 0, 3000)
    b, _ = await _prompts.calibrated_messages(count, 1, 3000)
    assert a[0]["content"].splitlines()[0] != b[0]["content"].splitlines()[0]
    assert a[1]["content"][:200] != b[1]["content"][:200]  # another file first
    assert _prompts.digest(a) != _prompts.digest(b)
    again, _ = await _prompts.calibrated_messages(count, 0, 3000)
    assert _prompts.digest(again) == _prompts.digest(a)  # deterministic


async def test_a_target_below_the_fixed_text_gets_the_shortest_prompt() -> None:
    msgs, n = await _prompts.calibrated_messages(_count_chars(), 0, 10)
    assert n > 10 and "# Tools" not in msgs[0]["content"]  # reported as it is, never cut mid-frame


def test_tools_are_json_schemas() -> None:
    tools = _prompts.agent_prompt().split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert len(tools) == 12
    for line in tools:
        fn = json.loads(line)["function"]
        assert fn["parameters"]["type"] == "object" and fn["name"]


def test_isa_summary() -> None:
    assert _llamacpp.isa_summary("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 |") == "avx2"
    assert _llamacpp.isa_summary("CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | ") == "avx512-vnni"
    assert _llamacpp.isa_summary("CPU : AVX2 = 1 | AVX_VNNI = 1 |") == "avx2-vnni"
    assert _llamacpp.isa_summary("CPU : NEON = 1 | ARM_FMA = 1 |") == "neon"
    assert _llamacpp.isa_summary("CPU : AVX512 = 0 | AVX2 = 1") == "avx2"
    assert _llamacpp.isa_summary(None) is None


class _Flash(enum.IntEnum):
    LLAMA_FLASH_ATTN_TYPE_AUTO = -1
    LLAMA_FLASH_ATTN_TYPE_DISABLED = 0


class _Spec(enum.IntEnum):
    COMMON_SPECULATIVE_TYPE_NONE = 0
    COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE = 1
    COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE = 6


def test_launcher_settings_follow_dotted_paths() -> None:
    xlc = types.SimpleNamespace(llama_flash_attn_type=_Flash, common_speculative_type=_Spec)
    params = types.SimpleNamespace(n_parallel=1, flash_attn_type=_Flash.LLAMA_FLASH_ATTN_TYPE_AUTO,
                                   cpuparams=types.SimpleNamespace(n_threads=-1),
                                   speculative=types.SimpleNamespace(types=[], draft=types.SimpleNamespace(
                                       n_max=16, mparams=types.SimpleNamespace(path=""))))
    for item in ("n_parallel=8", "cpuparams.n_threads=2", "flash_attn_type=disabled",
                 "speculative.types=DRAFT_SIMPLE,ngram_simple", "speculative.draft.n_max=4",
                 "speculative.draft.mparams.path=/m/d.gguf"):
        key, _, raw = item.partition("=")
        _llamacpp_launcher.apply_setting(xlc, params, key, _llamacpp_launcher.parse_value(raw))
    assert params.n_parallel == 8 and params.cpuparams.n_threads == 2
    assert params.flash_attn_type is _Flash.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert params.speculative.types == [_Spec.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE,
                                        _Spec.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
    assert params.speculative.draft.n_max == 4 and params.speculative.draft.mparams.path == "/m/d.gguf"
    with pytest.raises(SystemExit, match="no setting 'n_paralel'"):
        _llamacpp_launcher.apply_setting(xlc, params, "n_paralel", 8)
    assert _llamacpp_launcher.parse_value("true") is True and _llamacpp_launcher.parse_value("x") == "x"


def test_launcher_line_in_the_log(tmp_path: Path) -> None:
    log = tmp_path / "l.log"
    log.write_text('noise\nafm-bench-llamacpp: {"version": "1", "system_info": "AVX2 = 1"}\nmore\n')
    assert _llamacpp.launcher_info(log) == {"version": "1", "system_info": "AVX2 = 1"}
    log.write_text("nothing\n")
    assert _llamacpp.launcher_info(log) is None
    assert _llamacpp.launcher_info(tmp_path / "absent.log") is None


# --- model specs -------------------------------------------------------------

CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 512, "vocab_size": 64}


def _tiny_gguf(path: Path, *, tied: bool, template: str | None = "{{ messages }}") -> Path:
    rng = np.random.default_rng(0)
    h, v = CONFIG["hidden_size"], CONFIG["vocab_size"]
    tensors = [("token_embd.weight", rng.standard_normal((v, h)).astype(np.float32), "Q8_0"),
               ("blk.0.attn_q.weight", rng.standard_normal((h, h)).astype(np.float32), "Q8_0"),
               ("output_norm.weight", np.ones(h, np.float32), "F32")]
    if not tied:
        tensors.append(("output.weight", rng.standard_normal((v, h)).astype(np.float32), "Q8_0"))
    meta: dict[str, Any] = gw.llama_metadata(CONFIG)
    if template:
        meta["tokenizer.chat_template"] = template
    return gw.write_gguf(path, meta, tensors)


def test_forward_bytes_count_the_embedding_only_when_it_is_the_head(tmp_path: Path) -> None:
    assert _real_models.forward_bytes({"token_embd.weight": 100, "blk.0.x": 10, "output.weight": 50}) == 60
    assert _real_models.forward_bytes({"token_embd.weight": 100, "blk.0.x": 10}) == 110
    q8 = 34 * 64 * 64 // 32  # Q8_0: 34 bytes per 32 weights
    untied = _real_models.gguf_facts(_tiny_gguf(tmp_path / "u.gguf", tied=False))
    assert untied["weight_bytes"] == q8 + 64 * 4 + q8  # q, norm, head: not the embedding
    assert untied["context"] == 512 and untied["architecture"] == "llama" and untied["chat"]
    tied = _real_models.gguf_facts(_tiny_gguf(tmp_path / "t.gguf", tied=True, template=None))
    assert tied["weight_bytes"] == q8 + 64 * 4 + q8  # q, norm, embedding as the head
    assert not tied["chat"]


def test_safetensors_bytes_of_a_directory(random_model_dir: Path) -> None:
    n = _real_models.safetensors_weight_bytes(random_model_dir)
    total = sum(f.stat().st_size for f in random_model_dir.glob("*.safetensors"))
    assert n is not None and 0 < n < total  # the embedding left out, the header too


def test_named_models_are_found_or_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AFM_BENCH_GGUF_DIR", raising=False)
    monkeypatch.setenv("AFM_HOME", str(tmp_path / "home"))
    name = "qwen2.5-coder-0.5b"
    with pytest.raises(FileNotFoundError, match="--gguf-dir"):
        _real_models.find_known_gguf(name, [tmp_path / "empty"], fetch=False)
    store = tmp_path / "store"
    store.mkdir()
    _tiny_gguf(store / _real_models.KNOWN_MODELS[name], tied=False)
    specs, missing = _real_models.resolve_specs((name, str(tmp_path / "nope.gguf")),
                                                gguf_dir=(str(store),))
    assert [s.name for s in specs] == [name]
    assert specs[0].gguf == str(store / _real_models.KNOWN_MODELS[name])
    assert specs[0].context == 512 and specs[0].api == "chat"
    # this file has no tokenizer: afm cannot convert it, and says why instead of failing the run
    assert specs[0].directory is None and specs[0].afm_error
    assert "neither a model name" in missing[str(tmp_path / "nope.gguf")]


# --- the load generator's per-target body fields and kept text ---------------

async def _stub(nursery: trio.Nursery, bodies: list[dict[str, Any]]) -> int:
    async def handle(stream: trio.SocketStream) -> None:
        req = await read_request(stream, bytearray())
        if req is None:
            return
        bodies.append(json.loads(req[1]))
        frames = [{"choices": [{"delta": {"content": t}}]} for t in ("Hel", "lo", "!")]
        frames.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3},
                       "timings": {"draft_n": 4, "draft_n_accepted": 3}})
        data = b"".join(f"data: {json.dumps(f)}\n\n".encode() for f in frames) + b"data: [DONE]\n\n"
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                              b"Connection: close\r\n\r\n" + data)
        await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


async def test_target_fields_and_text() -> None:
    bodies: list[dict[str, Any]] = []
    wl = make_workload(0, 2, max_tokens=3)
    async with trio.open_nursery() as nursery:
        port = await _stub(nursery, bodies)
        url = f"http://127.0.0.1:{port}"
        kept = await run_closed(Target("llama", url, extra=(("cache_prompt", False),), keep_text=True),
                                wl, 1, 2, level_timeout=30, request_timeout=10)
        plain = await run_closed(Target("ours", url), wl, 1, 1, level_timeout=30, request_timeout=10)
        nursery.cancel_scope.cancel()
    assert [b.get("cache_prompt") for b in bodies] == [False, False, None]
    assert all(b["temperature"] == 0.0 and b["stream"] for b in bodies)
    assert [r.text for r in kept.requests] == ["Hello!", "Hello!"]
    assert kept.requests[0].timings == {"draft_n": 4, "draft_n_accepted": 3}
    assert plain.requests[0].text is None and plain.requests[0].output_tokens == 3


async def test_competing_load_spins_while_the_block_runs_and_stops_after() -> None:
    """``--competing-load N``: N processes busy on the CPU (CPU time grows) for
    the block, gone after it, even when the block fails."""
    import os

    from afm_core.bench._load import competing_load

    def cpu_ticks(pid: int) -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    async with competing_load(0) as none:
        assert none == []
    with pytest.raises(RuntimeError):
        async with competing_load(2) as pids:
            assert len(set(pids)) == 2
            if Path(f"/proc/{pids[0]}").exists():  # noqa: ASYNC240 (a stat of procfs)
                await trio.sleep(0.5)
                assert all(cpu_ticks(p) > 0 for p in pids)
            raise RuntimeError("the block failed")
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ValueError, match=">= 0"):
        async with competing_load(-1):
            pass


def test_a_negative_competing_load_is_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from afm_core._cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--real-model", "--competing-load", "-1"])
    assert exc.value.code == 2
    assert "--competing-load: must be >= 0" in capsys.readouterr().err
