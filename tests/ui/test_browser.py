"""The chat page in a real headless Chromium, against a real server on loopback
serving the echo model (it answers with the user's own text, token by token):
streaming, Stop (the cancel route: the stream ends "cancelled" and the engine
runs nothing), reasoning folded, tool calls by index, the profile, errors, the
API key field.  The server runs in its own thread (``serve_in_thread``) so the
synchronous selenium calls never block its Trio loop."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from afm_http import ServerConfig
from tests.http.fuzz_helpers import Server, serve_in_thread

LONG = "word " * 3000  # thousands of tokens: Stop lands mid-stream
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
SAID = ('<think>step by step</think>Checking.<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def server(echo_model_dir: Path) -> Iterator[Server]:
    with serve_in_thread(echo_model_dir, "ui-server", warmup=False) as srv:
        yield srv


def until(browser: Any, condition: Any, seconds: float = 20) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, seconds, poll_frequency=0.05).until(condition)


def js(browser: Any, script: str, *args: Any) -> Any:
    return browser.execute_script(script, *args)


def text(browser: Any, selector: str) -> str:
    """textContent of the last element matching ``selector`` (hidden ones too)."""
    return js(browser, "const n = document.querySelectorAll(arguments[0]);"
                       "return n.length ? n[n.length - 1].textContent : null;", selector)


def reply(browser: Any) -> dict[str, Any]:
    """The last assistant reply: its data-* attributes and texts."""
    return js(browser, """
        const r = [...document.querySelectorAll('article.assistant')].pop();
        const d = r.querySelector('details.reasoning');
        return {state: r.dataset.state, finish: r.dataset.finish, rid: r.dataset.requestId,
                classes: r.className, content: r.querySelector('.content').textContent,
                status: r.querySelector('.status').textContent,
                reasoning: d.hidden ? null : r.querySelector('.reasoning-text').textContent,
                reasoning_open: d.open,
                calls: [...r.querySelectorAll('.tool-call')].map(c => ({
                    index: c.dataset.index, name: c.querySelector('.tool-name').textContent,
                    args: c.querySelector('.tool-args').textContent}))};""")


def finished(browser: Any, seconds: float = 30) -> dict[str, Any]:
    until(browser, lambda d: reply(d)["state"] in ("done", "error"), seconds)
    return reply(browser)


def open_page(browser: Any, url: str) -> None:
    browser.get(url + "/")
    until(browser, lambda d: js(d, "return document.querySelectorAll('#model option').length") > 0)


def send(browser: Any, message: str, tools: list | None = None) -> None:
    js(browser, "document.getElementById('tools').value = arguments[0];",
       json.dumps(tools) if tools else "")
    js(browser, "document.getElementById('prompt').value = arguments[0];", message)
    browser.find_element("id", "send").click()


def test_stream_profile_and_stop(browser: Any, server: Server) -> None:
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server.url)
    assert text(browser, "#model option") == server.engine.model_id
    prompt = browser.find_element("id", "prompt")
    prompt.send_keys("hello browser", Keys.ENTER)  # Enter sends
    r = finished(browser)
    assert r["state"] == "done" and r["finish"] == "stop" and r["content"] == "hello browser"
    assert "finished: stop" in r["status"] and "completion tokens" in r["status"]
    assert r["rid"].startswith("ui-") and r["reasoning"] is None and r["calls"] == []
    # the profile event of that reply (X-AFM-Profile: true)
    assert browser.find_element("id", "profile-panel").is_displayed()
    profile = dict(zip(js(browser, "return [...document.querySelectorAll('#profile dt')].map(e => e.textContent)"),
                       js(browser, "return [...document.querySelectorAll('#profile dd')].map(e => e.textContent)"),
                       strict=True))
    assert {"decode_tok_s", "ttft_s", "prompt_tokens"} <= profile.keys()
    assert int(profile["completion_tokens"]) > 0 and float(profile["decode_tok_s"]) >= 0

    send(browser, LONG)
    until(browser, lambda d: len(reply(d)["content"]) > 40)  # streaming
    browser.find_element("id", "stop").click()
    r = finished(browser)
    assert r["state"] == "done" and r["finish"] == "cancelled", r
    assert r["status"].startswith("cancelled") and "cancelled" in r["classes"]
    assert 40 < len(r["content"]) < len(LONG.strip()) and LONG.startswith(r["content"])
    deadline = time.monotonic() + 10
    while server.statistics().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.statistics().running == 0
    assert browser.find_element("id", "send").is_enabled()
    assert not browser.find_element("id", "stop").is_enabled()


def test_reasoning_folded_and_tool_calls(browser: Any, server: Server) -> None:
    open_page(browser, server.url)
    send(browser, SAID, TOOLS)
    r = finished(browser)
    assert r["state"] == "done" and r["finish"] == "tool_calls", r
    assert r["reasoning"] == "step by step" and r["reasoning_open"] is False
    assert r["content"] == "Checking."
    (call,) = r["calls"]
    assert call["index"] == "0" and call["name"] == "get_weather"
    assert json.loads(call["args"]) == {"city": "Paris"}
    # the next turn carries the conversation (the assistant's tool call included)
    send(browser, "and now plain text")
    r = finished(browser)
    assert (r["state"], r["finish"], r["content"]) == ("done", "stop", "and now plain text")
    assert len(browser.find_elements("css selector", "article.msg")) == 4
    browser.find_element("id", "clear").click()
    assert browser.find_elements("css selector", "article.msg") == []


# What the page's fetch gets instead of the server's stream: frames split at
# awkward places (inside a line, between "\r" and "\n"), a keepalive comment,
# then the contract's error-marked chunk and [DONE].
FAKE_STREAM = r"""
const chunks = [
  ': keepalive\r\n\r\ndata: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,',
  '"delta":{"role":"assistant","content":"part"},"finish_reason":null}]}\r',
  '\n\r\ndata: {"id":"c","choices":[{"index":0,"delta":{"content":"ial"},"finish_reason":null}]}\n\n',
  'data: {"id":"c","choices":[],"error":{"message":"stream failed: boom","type":"server_error",',
  '"param":null,"code":"internal_error"}}\n\ndata: [DONE]\n\n'];
const real = window.fetch;
window.fetch = (url, init) => {
  if (!String(url).endsWith('chat/completions')) return real(url, init);
  const encoder = new TextEncoder();
  const body = new ReadableStream({start(c) { chunks.forEach(s => c.enqueue(encoder.encode(s))); c.close(); }});
  return Promise.resolve(new Response(body, {status: 200, headers: {'Content-Type': 'text/event-stream'}}));
};
"""


def test_mid_stream_error_chunk(browser: Any, server: Server) -> None:
    open_page(browser, server.url)
    js(browser, FAKE_STREAM)
    send(browser, "anything")
    r = finished(browser)
    assert r["state"] == "error" and r["content"] == "partial" and "error" in r["classes"]
    assert "error: stream failed: boom (internal_error)" in r["status"]


def test_api_key_field(browser: Any, echo_model_dir: Path) -> None:
    config = ServerConfig(api_key="sekret")
    with serve_in_thread(echo_model_dir, "ui-key-server", server=config, warmup=False) as srv:
        browser.get(srv.url + "/")  # the page itself needs no key
        until(browser, lambda d: d.find_element("id", "banner").is_displayed())
        banner = text(browser, "#banner")
        assert "HTTP 401" in banner and "Enter the API key" in banner
        send(browser, "needs a key")
        r = finished(browser)
        assert r["state"] == "error"
        assert "HTTP 401: missing or invalid API key" in r["status"] and "(invalid_api_key)" in r["status"]
        assert browser.find_element("id", "prompt").get_attribute("value") == "needs a key"

        from selenium.webdriver.common.keys import Keys

        browser.find_element("id", "api-key").send_keys("sekret", Keys.TAB)  # change: stored
        until(browser, lambda d: js(d, "return document.querySelectorAll('#model option').length") > 0)
        assert not browser.find_element("id", "banner").is_displayed()
        browser.find_element("id", "send").click()
        r = finished(browser)
        assert (r["state"], r["content"]) == ("done", "needs a key")
        open_page(browser, srv.url)  # a reload keeps the key (localStorage)
        assert browser.find_element("id", "api-key").get_attribute("value") == "sekret"
        assert not browser.find_element("id", "banner").is_displayed()
