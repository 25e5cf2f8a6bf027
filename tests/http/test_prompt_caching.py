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


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cached_system(ttl: str | None = None) -> list[Any]:
    control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": SYSTEM, "cache_control": control}]


async def test_breakpoints_are_written_then_read_and_pinned_for_their_ttl(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        clock = _Clock()
        cache = engine._worker.prefix_cache
        cache.clock = clock
        # the system breakpoint's prefix: the template's system turn, exactly
        n_system = len(await engine.tokenize(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"))
        n_opening = len(await engine.tokenize("<|im_start|>assistant\n"))
        client = client_for(url)

        async def ask(system: Any, content: Any) -> tuple[Any, int]:
            kw = {"model": "m", "system": system, "messages": [{"role": "user", "content": content}]}
            total = (await client.messages.count_tokens(**kw)).input_tokens
            usage = (await client.messages.create(max_tokens=20, **kw)).usage
            assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == total
            return usage, total

        first, total = await ask(cached_system(), "first question")
        assert (first.cache_read_input_tokens, first.cache_creation_input_tokens) == (0, n_system)
        assert first.input_tokens == total - n_system
        pins = cache.pins()
        assert [(len(prefix), expiry) for (_, prefix), expiry in pins.items()] == [(n_system, 1300.0)]

        # the next session reads the breakpoint (and the user turn's opening) and writes nothing
        second, total = await ask(cached_system(), "second question")
        assert second.cache_read_input_tokens >= n_system and second.cache_creation_input_tokens == 0
        assert second.input_tokens == total - second.cache_read_input_tokens

        # a breakpoint on the last user block (1h): everything but the assistant's opening
        # is written, less what was read
        third, total = await ask(SYSTEM, [{"type": "text", "text": "third question",
                                           "cache_control": {"type": "ephemeral", "ttl": "1h"}}])
        read = third.cache_read_input_tokens
        assert read >= n_system and third.cache_creation_input_tokens == total - n_opening - read
        assert third.input_tokens == n_opening
        assert sorted(expiry for expiry in cache.pins().values()) == [1300.0, 1000.0 + 3600]

        # no breakpoint: nothing written, as before
        plain, total = await ask(SYSTEM, "fourth question")
        assert plain.cache_creation_input_tokens == 0
        assert plain.input_tokens == total - plain.cache_read_input_tokens

        # a plain read of the pinned prefix 200 s later holds the pin for its ttl from then
        clock.now += 200
        refreshed, _ = await ask(SYSTEM, "fifth question")
        assert refreshed.cache_read_input_tokens >= n_system
        assert sorted(cache.pins().values()) == [1500.0, 1000.0 + 3600]

        clock.now += 301  # the 5-minute pin has expired; the hour's holds
        assert sorted(cache.pins().values()) == [1000.0 + 3600]
        clock.now += 3600 - 200
        assert cache.pins() == {}
        await client.close()


async def test_openai_routes_report_cached_tokens_only(echo_model_dir: Path) -> None:
    import httpx

    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        body = {"model": "m", "max_tokens": 10, "messages": [{"role": "system", "content": SYSTEM},
                                                             {"role": "user", "content": "hi"}]}
        await c.post("/v1/chat/completions", json=body)
        usage = (await c.post("/v1/chat/completions", json=body)).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": usage["prompt_tokens"] - 1}


async def test_bad_cache_control_is_a_bad_request(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = client_for(url)
        for control, param in (({"type": "persistent"}, "system.0.cache_control.type"),
                               ({"type": "ephemeral", "ttl": "2h"}, "system.0.cache_control.ttl"),
                               ("yes", "system.0.cache_control")):
            try:
                await client.messages.create(
                    model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}],
                    system=[{"type": "text", "text": "s", "cache_control": control}])  # type: ignore[typeddict-item]
            except anthropic.BadRequestError as exc:
                assert exc.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
                assert exc.body["error"]["message"].startswith(param)  # type: ignore[index]
            else:
                raise AssertionError(f"{control!r} was accepted")
        await client.close()


async def _squeezed(url: str, engine: Any, pinned: bool) -> int:
    """Tokens the session's system prompt reads back after other sessions
    squeezed the memory tier to about two entries."""
    client = client_for(url)
    system: Any = cached_system() if pinned else SYSTEM
    await client.messages.create(model="m", max_tokens=5, system=system,
                                 messages=[{"role": "user", "content": "first"}])
    worker = engine._worker
    one = worker.prefix_cache.nbytes
    worker.prefix_cache_bytes = int(2.5 * one)  # the test's squeeze: about two entries fit
    for i in range(4):  # other sessions, as long, sharing nothing with it
        other = "".join(f"Other {i} line {j}: nothing in common here at all.\n" for j in range(60))
        await client.messages.create(model="m", max_tokens=5, system=other,
                                     messages=[{"role": "user", "content": "first"}])
    assert len(worker.prefix_cache) <= 3  # of the 5 sessions: the oldest ones went
    again = await client.messages.create(model="m", max_tokens=5, system=system,
                                         messages=[{"role": "user", "content": "again"}])
    await client.close()
    return again.usage.cache_read_input_tokens


async def test_a_pinned_prefix_survives_the_squeeze_that_evicts_unpinned_ones(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        n_system = len(await engine.tokenize(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"))
        assert await _squeezed(url, engine, pinned=True) >= n_system
    async with running_server(echo_model_dir) as (url, engine):
        assert await _squeezed(url, engine, pinned=False) < 10  # evicted: the template's start only


async def test_the_billing_line_is_taken_out_on_chat_too(echo_model_dir: Path) -> None:
    import httpx

    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        usages = []
        for cch in ("a1", "b2"):
            system = f"x-anthropic-billing-header: cc_version=2.1.197.{cch}; cch={cch};\n{SYSTEM}"
            body = {"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": system},
                                                                {"role": "user", "content": f"hi {cch}"}]}
            usages.append((await c.post("/v1/chat/completions", json=body)).json()["usage"])
        second = usages[1]
        assert second["prompt_tokens_details"]["cached_tokens"] > 0.9 * second["prompt_tokens"]
