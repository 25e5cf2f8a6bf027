"""Prompt caching agents can count on (issue 30): volatile system lines taken
out before templating, and ``cache_control`` breakpoints reported truthfully in
Anthropic's usage, on a real server with the anthropic SDK."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic

from afm_http.testing import running_server

SYSTEM = "You are Claude Code, an agent.\n" + "".join(
    f"Rule {i}: read the file before editing it, and keep the diff small.\n" for i in range(60))
TOOLS: list[Any] = [{"name": "Bash", "description": "Run a command",
                     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]


def client_for(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


def claude_code_body(cch: str, question: str) -> dict[str, Any]:
    """Claude Code's shape: the billing line as the first system block, per prompt."""
    return {
        "model": "claude-sonnet-4-5", "max_tokens": 20,
        "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{cch}; "
                                             f"cc_entrypoint=cli; cch={cch};"},
                   {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "tools": TOOLS,
        "messages": [{"role": "user", "content": question}],
    }


async def _two_sessions(url: str) -> tuple[Any, Any]:
    client = client_for(url)
    first = await client.messages.create(**claude_code_body("a91f3", "list the files"))
    second = await client.messages.create(**claude_code_body("07c2e", "show the diff"))
    await client.close()
    return first.usage, second.usage


async def test_the_billing_line_does_not_split_the_prefix(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        first, second = await _two_sessions(url)
    total = second.input_tokens + second.cache_read_input_tokens + second.cache_creation_input_tokens
    # the second session reads everything up to its own question from the first's entry
    assert second.cache_read_input_tokens > 0.9 * total, second
    assert first.cache_read_input_tokens == 0


async def test_keep_volatile_lines_turns_it_off(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir, keep_volatile_lines=True) as (url, _):
        _, second = await _two_sessions(url)
    total = second.input_tokens + second.cache_read_input_tokens + second.cache_creation_input_tokens
    # the lines differ a few tokens in: only the template's start is shared
    assert second.cache_read_input_tokens < 0.1 * total, second


def test_the_rule_list_removes_whole_lines_only() -> None:
    from afm_core.api.volatile import strip_volatile_lines, strip_volatile_messages

    text = "x-anthropic-billing-header: cc_version=1; cch=ab;\nYou are helpful.\nsay x-anthropic-billing-header: no\n"
    assert strip_volatile_lines(text) == "You are helpful.\nsay x-anthropic-billing-header: no\n"
    assert strip_volatile_lines("plain") == "plain"
    messages = [{"role": "system", "content": [{"type": "text", "text": text}]},
                {"role": "user", "content": text}]
    out = strip_volatile_messages(messages)
    assert out[0]["content"][0]["text"] == "You are helpful.\nsay x-anthropic-billing-header: no\n"
    assert out[1] == messages[1]  # only system text is touched
