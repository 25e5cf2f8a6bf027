"""The real Codex CLI (``@openai/codex``, pinned in ``.ci/deps.sh``) against a real
afm server on the echo model, through a custom provider with ``wire_api =
"responses"`` in a temporary ``CODEX_HOME`` (Codex's default features: none
turned off).

The echo model answers with the last user turn, token for token, so the
prompt given to ``codex exec`` is the model's answer: a ``<tool_call>`` block
naming Codex's shell tool (``exec_command``) makes a function call Codex runs;
the call's output comes back as a user turn holding ``<tool_response>``, which
the model echoes as its final answer.  Skipped when ``codex`` is not on PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import trio

from afm_core.api.responses_request import COMPACTED_HEADER, SUMMARY_PROMPT
from afm_core.testing import make_echo_model
from afm_http import ServerConfig
from afm_http.testing import running_server

CODEX = shutil.which("codex")
VERSION = "0.171.0"
KEY = "afm-codex-test-key"
pytestmark = pytest.mark.skipif(
    CODEX is None, reason=f"the Codex CLI is not on PATH (npm install -g @openai/codex@{VERSION})")


@pytest.fixture(scope="module")
def codex_echo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The echo model with room for Codex's prompts (its tools and instructions
    are ~40 kB, far more tokens with the test tokenizer)."""
    return make_echo_model(tmp_path_factory.mktemp("echo-codex"), context_length=262144)


def tool_call(command: str) -> str:
    call = {"name": "exec_command", "arguments": {"cmd": command}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


async def run_codex(tmp: Path, url: str, prompt: str, *, provider: str = "", name: str = "afm",
                    config: str = "") -> tuple[subprocess.CompletedProcess[bytes], str]:
    """``codex exec`` in ``tmp/work`` with a fresh ``CODEX_HOME``: (the process, its last message)."""
    assert CODEX is not None
    home, work = tmp / "codex-home", tmp / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    (home / "config.toml").write_text(f"""\
model = "afm"
model_provider = "afm"
check_for_update_on_startup = false
{config}

[analytics]
enabled = false

[model_providers.afm]
name = "{name}"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "AFM_CODEX_TEST_KEY"
request_max_retries = 0
stream_max_retries = 0
{provider}
""")
    last = tmp / "last-message.txt"
    env = {**os.environ, "CODEX_HOME": str(home), "AFM_CODEX_TEST_KEY": KEY, "NO_COLOR": "1"}
    with trio.fail_after(180):
        proc = await trio.run_process(
            [CODEX, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
             "--color", "never", "--output-last-message", str(last), "-C", str(work), prompt],
            stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False,
            env=env)
    return proc, last.read_text() if last.exists() else ""


def explain(proc: subprocess.CompletedProcess[bytes]) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout.decode()[-3000:]}\nstderr:\n" \
           f"{proc.stderr.decode()[-3000:]}"


async def test_codex_version_is_the_pinned_one() -> None:
    assert CODEX is not None
    proc = await trio.run_process([CODEX, "--version"], capture_stdout=True, capture_stderr=True,
                                  stdin=subprocess.DEVNULL)
    version = proc.stdout.decode().strip()
    print(f"Codex CLI: {version}")
    assert version == f"codex-cli {VERSION}"


async def test_codex_exec_runs_a_shell_tool_call_and_answers(codex_echo: Path,
                                                             tmp_path: Path) -> None:
    server = ServerConfig(api_key=KEY)
    async with running_server(codex_echo, server=server) as (url, engine):
        proc, last = await run_codex(tmp_path, url, tool_call("echo afm-codex-ok > marker.txt; "
                                                              "cat marker.txt"))
        assert proc.returncode == 0, explain(proc)
        # the command ran in the work dir, and its output came back to the model, which
        # (being the echo model) answered with the tool response
        assert (tmp_path / "work" / "marker.txt").read_text() == "afm-codex-ok\n"
        assert "afm-codex-ok" in last and "<tool_response>" in last, explain(proc)
        stats = engine.statistics()
        assert stats.requests_active == 0

        # a wrong key is refused: the provider's env_key is what Codex sends
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/responses", json={"input": "x"},
                             headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401


@pytest.mark.parametrize("keepalive", [0.2, 0.0], ids=["keepalive", "no-keepalive"])
async def test_a_long_wait_is_kept_alive_past_codex_stream_idle_timeout(
        codex_echo: Path, tmp_path: Path, keepalive: float) -> None:
    """Codex's stream idle timer counts events, not SSE comments: while its request
    waits (here behind the only batch slot, held by another stream for 4 s, twice
    Codex's idle timeout) afm re-sends ``response.in_progress``.  Without keepalives
    the same wait ends Codex's turn with an idle timeout (the control)."""
    server = ServerConfig(api_key=KEY, keepalive_seconds=keepalive)
    async with running_server(codex_echo, server=server, max_batch=1) as (url, _), \
            httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                              timeout=60) as c, trio.open_nursery() as nursery:
        hog_started = trio.Event()

        async def hog() -> None:
            # ~60k tokens echoed at well under 1k tokens/s: it never ends by itself in the test
            body = {"model": "m", "stream": True, "max_tokens": 100000,
                    "messages": [{"role": "user", "content": "word " * 20000}]}
            async with c.stream("POST", "/v1/chat/completions", json=body,
                                headers={"X-Request-ID": "hog"}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and not hog_started.is_set():
                        hog_started.set()
                        await trio.sleep(4)  # the slot stays taken while Codex waits
                        await c.post("/v1/chat/completions/hog/cancel")

        nursery.start_soon(hog)
        with trio.fail_after(30):
            await hog_started.wait()
        proc, last = await run_codex(tmp_path, url, "still there?",
                                     provider="stream_idle_timeout_ms = 2000")
    if keepalive:
        assert proc.returncode == 0, explain(proc)
        assert last == "still there?"
    else:
        assert proc.returncode != 0 and last == "", explain(proc)
        assert "idle" in (proc.stdout + proc.stderr).decode().lower(), explain(proc)


@pytest.mark.parametrize("name", ["afm", "OpenAI"], ids=["local-compaction", "remote-compaction"])
async def test_codex_auto_compaction_mid_turn(codex_echo: Path, tmp_path: Path, name: str) -> None:
    """With a small auto-compact limit Codex compacts between the tool call and the
    answer.  Codex compacts remotely only for a provider it takes for OpenAI's
    (``name = "OpenAI"``): 0.171 sends ``/v1/responses`` with a final
    ``compaction_trigger`` item and puts the ``compaction`` item afm answers
    with in its history, so the next turn's last user turn is afm's summary
    (echoed).  Any other name compacts locally: an ordinary turn with Codex's
    own summarising prompt, whose answer Codex keeps as a user message."""
    async with running_server(codex_echo, server=ServerConfig(api_key=KEY)) as (url, _):
        proc, last = await run_codex(
            tmp_path, url, tool_call("echo compact-me > marker.txt"), name=name,
            config="model_auto_compact_token_limit = 8000\nmodel_context_window = 100000")
    assert proc.returncode == 0, explain(proc)
    assert (tmp_path / "work" / "marker.txt").read_text() == "compact-me\n"
    assert "context compacted" in (proc.stdout + proc.stderr).decode(), explain(proc)
    if name == "OpenAI":
        assert last.strip() == (COMPACTED_HEADER + SUMMARY_PROMPT).strip(), explain(proc)
    else:
        assert COMPACTED_HEADER not in last and "summary" in last.lower(), explain(proc)
