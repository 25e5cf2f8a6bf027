"""The real Claude Code CLI (``@anthropic-ai/claude-code``, unmodified) against a
real afm server on the echo model: ``claude -p`` with one tool round trip, and
two sessions sharing their prompt prefix (its per-prompt billing line taken out).

The echo model answers with the last user message, token for token, so a prompt
that is a ``<tool_call>`` in the template's format comes back as that tool call,
Claude Code runs it, and the tool result (now the last user turn) comes back as
the final answer.  Skipped, saying so, where ``claude`` is not on PATH
(``.ci/deps.sh`` installs the pinned version as root: ``npm install -g
@anthropic-ai/claude-code@2.1.197``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from afm_core.testing import make_echo_model
from afm_http import ServerConfig
from afm_http.testing import running_server

CLAUDE = shutil.which("claude")
TRIED_VERSION = "2.1.197"  # the version .ci/deps.sh installs, and these tests were written with
# Claude Code's system prompt and tool definitions are ~46k tokens with the test
# tokenizer (1024-token vocabulary); it asks for max_tokens 32000, more than the
# rest of this context, which afm caps
CONTEXT = 65536


def claude_version() -> str:
    """``claude --version``'s number (e.g. ``2.1.197``)."""
    assert CLAUDE is not None
    out = subprocess.run([CLAUDE, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.match(r"\s*(\S+)", out)
    assert m, out
    return m.group(1)


VERSION = claude_version() if CLAUDE else "absent"
if CLAUDE and VERSION != TRIED_VERSION:
    warnings.warn(f"Claude Code {VERSION} on PATH; these tests were written with {TRIED_VERSION}",
                  stacklevel=1)

pytestmark = [
    pytest.mark.skipif(CLAUDE is None, reason="Claude Code not on PATH (npm install -g "
                       "@anthropic-ai/claude-code@2.1.197; .ci/deps.sh does as root)"),
    # the client's version is in every test's id (test_...[claude-code-2.1.197]) and properties
    pytest.mark.parametrize("version", [VERSION], ids=[f"claude-code-{VERSION}"]),
]


@pytest.fixture(scope="module")
def big_echo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_echo_model(tmp_path_factory.mktemp("echo-cc"), context_length=CONTEXT)


def claude_env(home: Path, url: str, key: str) -> dict[str, str]:
    """The inherited environment less any Anthropic/Claude settings, with a
    fresh HOME and config dir, afm as the API and no traffic elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "CLAUDE", "DISABLE_"))}  # CLAUDECODE too
    env.update({
        "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "NO_COLOR": "1",
    })
    return env


async def served_model(url: str, key: str) -> str:
    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}"}) as client:
        r = await client.get("/v1/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def claude_p(url: str, home: Path, cwd: Path, prompt: str, *, key: str = "unused",
                   fmt: str = "json", tools: str = "Bash", model: str | None = None,
                   env: dict[str, str] | None = None,
                   ) -> tuple[subprocess.CompletedProcess[bytes], list[dict[str, Any]]]:
    """``claude -p PROMPT`` (``tools`` allowed without asking: ``--dangerously-skip-permissions``
    is refused as root), its output parsed as JSON lines."""
    assert CLAUDE is not None
    model = model or await served_model(url, key)
    argv = [CLAUDE, "-p", prompt, "--model", model, "--allowedTools", tools,
            "--output-format", fmt, *(["--verbose"] if fmt == "stream-json" else [])]
    with trio.fail_after(240):
        proc = await trio.run_process(argv, cwd=cwd, env={**claude_env(home, url, key), **(env or {})},
                                      capture_stdout=True, capture_stderr=True, check=False)
    lines = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]
    return proc, lines


def result_of(proc: subprocess.CompletedProcess[bytes], lines: list[dict[str, Any]]) -> dict[str, Any]:
    results = [e for e in lines if e.get("type") == "result"]
    assert proc.returncode == 0 and len(results) == 1, (proc.returncode, proc.stdout, proc.stderr)
    return results[0]


def tool_call_prompt(command: str) -> str:
    """A prompt the echo model turns into a Bash tool call in the template's format."""
    call = {"name": "Bash", "arguments": {"command": command, "description": "Show the note"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


async def test_claude_p_runs_a_tool_round_trip(big_echo_dir: Path, tmp_path: Path, version: str,
                                               record_property: Any) -> None:
    record_property("claude_code_version", version)
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text("the note says 7f3a9c\n")
    key = "sk-afm-test"
    async with running_server(big_echo_dir, server=ServerConfig(api_key=key)) as (url, _):
        proc, lines = await claude_p(url, tmp_path / "home", work, tool_call_prompt("cat note.txt"),
                                     key=key, fmt="stream-json",
                                     env={"CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(CONTEXT)})
    result = result_of(proc, lines)
    # the served context, told (docs/agents.md), is the window Claude Code compacts within
    assert [u["contextWindow"] for u in result["modelUsage"].values()] == [CONTEXT], result
    init = next(e for e in lines if e.get("type") == "system" and e.get("subtype") == "init")
    assert init["claude_code_version"] == version
    assert not result["is_error"], result
    assert result["num_turns"] == 2, result

    # the model's tool call, as Claude Code parsed it from afm's stream
    blocks = [b for e in lines if e.get("type") == "assistant" for b in e["message"]["content"]]
    uses = [b for b in blocks if b["type"] == "tool_use"]
    assert [(u["name"], u["input"]["command"]) for u in uses] == [("Bash", "cat note.txt")], blocks
    assert re.fullmatch(r"toolu_\w+", uses[0]["id"]), uses
    # ... that Claude Code ran, sending its output back
    tool_results = [b for e in lines if e.get("type") == "user" for b in e["message"]["content"]
                    if isinstance(b, dict) and b.get("type") == "tool_result"]
    assert len(tool_results) == 1 and tool_results[0]["tool_use_id"] == uses[0]["id"], lines
    assert not tool_results[0].get("is_error") and "7f3a9c" in str(tool_results[0]["content"])
    # ... which the echo model answered with: the final answer holds the file's text
    assert result["result"] == "<tool_response>\nthe note says 7f3a9c\n</tool_response>", result
    assert result["stop_reason"] == "end_turn"


async def two_sessions(url: str, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two ``claude -p`` sessions (no tool call: one request each), their usage."""
    work = tmp_path / "work"
    work.mkdir()
    usages = []
    for question in ["list the files", "what does this project do"]:
        proc, lines = await claude_p(url, tmp_path / "home", work, question)
        result = result_of(proc, lines)
        assert not result["is_error"] and result["num_turns"] == 1, result
        assert result["result"].endswith(question), result  # the echo
        usages.append(result["usage"])
    return usages[0], usages[1]


def prompt_of(usage: dict[str, Any]) -> int:
    return int(usage["input_tokens"] + usage["cache_read_input_tokens"]
               + usage["cache_creation_input_tokens"])


async def test_a_second_session_reads_the_first_ones_prefix(big_echo_dir: Path, tmp_path: Path,
                                                            version: str, record_property: Any) -> None:
    """Claude Code's first system block is a billing line with a per-prompt value;
    afm takes it out, so the second session reads the first's ~46k-token prefix."""
    record_property("claude_code_version", version)
    async with running_server(big_echo_dir) as (url, _):
        first, second = await two_sessions(url, tmp_path)
        async with httpx.AsyncClient(base_url=url) as client:
            metrics = (await client.get("/metrics")).text
    record_property("usage", [first, second])
    # the server's own count agrees with the usage Claude Code got
    cached = re.search(r"^afm_cached_prompt_tokens_total\{[^}]*\} (\d+)", metrics, re.M)
    assert cached and int(cached.group(1)) == second["cache_read_input_tokens"], metrics
    assert prompt_of(first) > 20000, first  # the system prompt and tools
    assert first["cache_read_input_tokens"] == 0, first
    # Claude Code sets cache_control breakpoints: afm reports their prefix written
    assert first["cache_creation_input_tokens"] > 0.9 * prompt_of(first), first
    assert second["cache_read_input_tokens"] > 0.9 * prompt_of(second), second


async def test_with_the_billing_line_kept_the_sessions_share_little(
        big_echo_dir: Path, tmp_path: Path, version: str, record_property: Any) -> None:
    """The check above can fail: kept (``--keep-volatile-lines``), the billing
    line differs between the sessions a few tokens in."""
    record_property("claude_code_version", version)
    async with running_server(big_echo_dir, keep_volatile_lines=True) as (url, _):
        _, second = await two_sessions(url, tmp_path)
    assert second["cache_read_input_tokens"] < 0.1 * prompt_of(second), second


async def test_a_context_too_small_is_claude_codes_prompt_too_long(
        echo_model_dir: Path, tmp_path: Path, version: str, record_property: Any) -> None:
    """afm's 400 for a prompt over the context is one Claude Code recognises."""
    record_property("claude_code_version", version)
    work = tmp_path / "work"
    work.mkdir()
    async with running_server(echo_model_dir) as (url, _):  # 32768 tokens
        proc, lines = await claude_p(url, tmp_path / "home", work, "hello")
    result = [e for e in lines if e.get("type") == "result"]
    assert len(result) == 1, (proc.stdout, proc.stderr)
    assert result[0]["is_error"] and result[0]["api_error_status"] == 400, result
    assert result[0].get("terminal_reason") == "prompt_too_long", result


async def test_two_tool_calls_in_one_turn_a_failing_command_and_a_write(
        big_echo_dir: Path, tmp_path: Path, version: str, record_property: Any) -> None:
    record_property("claude_code_version", version)
    work = tmp_path / "work"
    work.mkdir()
    calls = [{"name": "Bash", "arguments": {"command": "ls no-such-dir", "description": "Fail"}},
             {"name": "Write", "arguments": {"file_path": str(work / "made.txt"), "content": "by the echo\n"}}]
    prompt = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    async with running_server(big_echo_dir) as (url, _):
        proc, lines = await claude_p(url, tmp_path / "home", work, prompt, fmt="stream-json",
                                     tools="Bash Write")
    result = result_of(proc, lines)
    assert not result["is_error"], result
    uses = [b for e in lines if e.get("type") == "assistant" for b in e["message"]["content"]
            if b["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["Bash", "Write"], uses
    assert (work / "made.txt").read_text() == "by the echo\n"  # Claude Code wrote it
    outcome = {b["tool_use_id"]: b for e in lines if e.get("type") == "user"
               for b in e["message"]["content"] if isinstance(b, dict) and b.get("type") == "tool_result"}
    assert outcome[uses[0]["id"]].get("is_error") and not outcome[uses[1]["id"]].get("is_error"), outcome
    # one final answer echoing both results, in order
    answer = result["result"]
    assert answer.count("<tool_response>") == 2 and "no-such-dir" in answer, result
    assert answer.index("no-such-dir") < answer.index("made.txt"), result


async def test_a_wrong_key_fails_at_once(echo_model_dir: Path, tmp_path: Path, version: str,
                                         record_property: Any) -> None:
    """afm's 401 says ``x-should-retry: false``: without it Claude Code retries
    ten times with backoff, minutes of silence before its error."""
    record_property("claude_code_version", version)
    work = tmp_path / "work"
    work.mkdir()
    async with running_server(echo_model_dir, server=ServerConfig(api_key="right")) as (url, _):
        with trio.fail_after(60):
            proc, lines = await claude_p(url, tmp_path / "home", work, "hello", key="wrong",
                                         model="m")
    result = [e for e in lines if e.get("type") == "result"]
    assert len(result) == 1, (proc.stdout, proc.stderr)
    assert result[0]["is_error"] and result[0]["api_error_status"] == 401, result
    assert "Invalid API key" in result[0]["result"], result


def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                   cwd=cwd, check=True, capture_output=True, timeout=60)


async def commit_between_sessions(url: str, tmp_path: Path, env: dict[str, str]) -> dict[str, Any]:
    """The second session's usage, in a git repository with a commit since the first."""
    work = tmp_path / "repo"
    work.mkdir(parents=True)
    git(work, "init", "-q")
    for i, question in enumerate(["what changed", "what changed since"]):
        (work / "a.txt").write_text(f"version {i}\n")
        git(work, "add", "a.txt")
        git(work, "commit", "-qm", f"change {i}")
        proc, lines = await claude_p(url, tmp_path / "home", work, question, env=env)
        result = result_of(proc, lines)
        assert not result["is_error"] and result["num_turns"] == 1, result
    return dict(result["usage"])


@pytest.mark.skipif(shutil.which("git") is None, reason="git not on PATH")
async def test_a_commit_between_sessions_and_the_git_snapshot(big_echo_dir: Path, tmp_path: Path,
                                                              version: str, record_property: Any) -> None:
    """In a git repository the system prompt ends with a ``git status`` snapshot,
    which the template renders before the tools: a commit between two sessions
    costs the tools' prefill, unless ``CLAUDE_CODE_DISABLE_GIT_INSTRUCTIONS=1``
    (docs/agents.md)."""
    record_property("claude_code_version", version)
    async with running_server(big_echo_dir) as (url, _):
        with_snapshot = await commit_between_sessions(url, tmp_path / "a", {})
        without = await commit_between_sessions(
            url, tmp_path / "b", {"CLAUDE_CODE_DISABLE_GIT_INSTRUCTIONS": "1"})
    record_property("usage_after_commit", with_snapshot)
    record_property("usage_after_commit_without_snapshot", without)
    assert with_snapshot["cache_read_input_tokens"] < 0.5 * prompt_of(with_snapshot), with_snapshot
    assert without["cache_read_input_tokens"] > 0.9 * prompt_of(without), without


async def test_reading_a_picture_does_not_end_the_session(big_echo_dir: Path, tmp_path: Path,
                                                          version: str, record_property: Any) -> None:
    """Claude Code's Read returns a picture as an image block in the tool result:
    afm (text only) answers with a note in its place, and the session goes on."""
    record_property("claude_code_version", version)
    work = tmp_path / "work"
    work.mkdir()
    # a 1x1 PNG
    (work / "dot.png").write_bytes(bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c4944415408"
        "d763f8cfc000000301010018dd8db00000000049454e44ae426082"))
    call = {"name": "Read", "arguments": {"file_path": str(work / "dot.png")}}
    async with running_server(big_echo_dir) as (url, _):
        proc, lines = await claude_p(url, tmp_path / "home", work,
                                     f"<tool_call>\n{json.dumps(call)}\n</tool_call>",
                                     fmt="stream-json", tools="Read")
    result = result_of(proc, lines)
    sent = [b for e in lines if e.get("type") == "user" for b in e["message"]["content"]
            if isinstance(b, dict) and b.get("type") == "tool_result"]
    assert [c["type"] for c in sent[0]["content"]] == ["image"], sent  # what Claude Code sent
    assert not result["is_error"], result
    assert result["result"] == "<tool_response>\n[image omitted: this model reads text only]\n</tool_response>"
