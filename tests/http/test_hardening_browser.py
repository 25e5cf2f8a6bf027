"""Issue 31, case 1 (and 9's API key): what a web page may ask of a server.

Without ``--api-key`` a page on another origin could drain the server
(``fetch(..., {mode: "no-cors"})``), any body was parsed as JSON whatever its
``Content-Type`` (a ``text/plain`` body generated) and any ``Host`` was served
(DNS rebinding).  Now: a foreign ``Origin`` or ``Host`` is a 403, a body that
is not JSON a 415, ``/admin/*`` refuses cross-site requests even with a key;
with a key the rest is as before.  A real headless Chromium on another origin
shows the drain and a generation refused.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from afm_http import ServerConfig
from afm_http.testing import running_server

CHAT = "/v1/chat/completions"
BODY = b'{"messages": [{"role": "user", "content": "fine"}]}'
JSON = {"Content-Type": "application/json"}
BROWSER_UA = "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/156.0 Safari/537.36"


def code_of(r: httpx.Response) -> str:
    return r.json()["error"]["code"]


async def test_bodies_must_be_json_without_a_key(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                     "application/jsonx", "text/json"):
            for marks in ({"User-Agent": BROWSER_UA}, {"Sec-Fetch-Mode": "no-cors"},
                          {"Origin": url}, {"User-Agent": "curl/8.5.0"}, {}):
                r = await c.post(CHAT, content=BODY, headers={"Content-Type": kind, **marks})
                assert r.status_code == 415 and code_of(r) == "unsupported_media_type", (kind, marks)
        r = await c.post(CHAT, content=BODY, headers={"User-Agent": BROWSER_UA})  # no type (a Blob body)
        assert r.status_code == 415
        r = await c.post("/v1/messages", content=b'{"model": "x", "max_tokens": 5, "messages": []}',
                         headers={"Content-Type": "text/plain", "User-Agent": BROWSER_UA})
        assert r.status_code == 415 and r.json()["type"] == "error"  # Anthropic's envelope there
        assert engine.statistics().requests_total == 0  # nothing generated
        # a command line's form-typed JSON (curl -d) too, told how to send it
        r = await c.post(CHAT, content=BODY, headers={
            "Content-Type": "application/x-www-form-urlencoded", "User-Agent": "curl/8.5.0"})
        assert r.status_code == 415 and "-H 'Content-Type: application/json'" in r.json()["error"]["message"]
        r = await c.post("/api/chat", content=b'{"model": "m", "messages": []}',
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415  # the Ollama routes too
        for kind in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                     "application/vnd.afm+json"):
            r = await c.post(CHAT, content=BODY, headers={"Content-Type": kind})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "fine", kind
        # no body: nothing to type (a cancel)
        assert (await c.post(f"{CHAT}/nobody/cancel")).status_code == 404


async def test_host_must_name_this_server_without_a_key(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        port = url.rsplit(":", 1)[1]
        for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example",
                     "localhost.attacker.example", ""):
            r = await c.post(CHAT, content=BODY, headers={**JSON, "Host": host})
            assert r.status_code == 403 and code_of(r) == "host_not_allowed", host
            assert (await c.get("/v1/models", headers={"Host": host})).status_code == 403
        assert engine.statistics().requests_total == 0
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", "LOCALHOST.", "app.localhost",
                     "[::1]:9", "10.1.2.3"):
            r = await c.post(CHAT, content=BODY, headers={**JSON, "Host": host})
            assert r.status_code == 200, host
        # a balancer's health check may send no Host (HTTP/1.0) or its own
        assert (await c.get("/health", headers={"Host": "lb.internal"})).status_code == 200
    cfg = ServerConfig(allowed_hosts=("afm.internal",))
    async with running_server(echo_model_dir, server=cfg) as (url, _), httpx.AsyncClient(base_url=url) as c:
        assert (await c.post(CHAT, content=BODY, headers={**JSON, "Host": "afm.internal:80"})).status_code == 200
        assert (await c.post(CHAT, content=BODY, headers={**JSON, "Host": "afm.other"})).status_code == 403


async def test_foreign_origins_are_refused_without_a_key(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        port = url.rsplit(":", 1)[1]
        for origin in ("http://evil.example", f"http://localhost:{int(port) + 1}", "null",
                       f"https://127.0.0.1:{port}/x", "file://"):
            r = await c.post(CHAT, content=BODY, headers={**JSON, "Origin": origin})
            assert r.status_code == 403 and code_of(r) == "origin_not_allowed", origin
            r = await c.options(CHAT, headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
            assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        r = await c.post(CHAT, content=BODY, headers={**JSON, "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 403
        r = await c.post("/admin/drain", headers={"Origin": "http://evil.example"})
        assert r.status_code == 403
        assert (await c.get("/health")).json()["status"] == "ok"
        assert engine.statistics().requests_total == 0
        # the server's own page
        r = await c.post(CHAT, content=BODY, headers={**JSON, "Origin": url, "Sec-Fetch-Site": "same-origin"})
        assert r.status_code == 200
    cfg = ServerConfig(cors_origins=("http://app.example",))
    async with running_server(echo_model_dir, server=cfg) as (url, _), httpx.AsyncClient(base_url=url) as c:
        r = await c.post(CHAT, content=BODY, headers={**JSON, "Origin": "http://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        assert (await c.post(CHAT, content=BODY, headers={**JSON, "Origin": "http://b.example"})).status_code == 403


async def test_with_a_key_as_before_but_admin_refuses_cross_site(echo_model_dir: Path) -> None:
    cfg = ServerConfig(api_key="k")
    key = {"Authorization": "Bearer k"}
    async with running_server(echo_model_dir, server=cfg) as (url, _), httpx.AsyncClient(base_url=url) as c:
        r = await c.post(CHAT, content=BODY, headers={**key, "Content-Type": "text/plain",
                                                       "Host": "anything.example"})
        assert r.status_code == 200  # a page cannot send the key: the key is the protection
        for cross in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                      {"Sec-Fetch-Site": "same-site"}):
            r = await c.post("/admin/drain", headers={**key, **cross})
            assert r.status_code == 403 and code_of(r) == "cross_site_refused", cross
            assert (await c.delete("/admin/drain", headers={**key, **cross})).status_code == 403
        assert (await c.get("/health")).json()["status"] == "ok"
        r = await c.post("/admin/drain", headers={**key, "Origin": url})
        assert r.status_code == 202
        assert (await c.delete("/admin/drain", headers=key)).status_code == 200


async def test_a_utf8_api_key_matches_what_clients_send(echo_model_dir: Path) -> None:
    """Case 9: a non-ASCII key never matched (the header's bytes were read as Latin-1)."""
    secret = "clé-🔑-ключ"
    cfg = ServerConfig(api_key=secret)
    async with running_server(echo_model_dir, server=cfg) as (url, _), httpx.AsyncClient(base_url=url) as c:
        good = b"Bearer " + secret.encode("utf-8")
        r = await c.post(CHAT, content=BODY, headers={**JSON, "Authorization": good})  # type: ignore[dict-item]
        assert r.status_code == 200, r.text
        r = await c.post("/v1/messages", content=b'{"model": "x", "max_tokens": 5, "messages": '
                         b'[{"role": "user", "content": "hi"}]}',
                         headers={**JSON, "x-api-key": secret.encode("utf-8")})  # type: ignore[dict-item]
        assert r.status_code == 200, r.text
        for wrong in (b"Bearer " + secret.encode("latin-1", "replace"), b"Bearer " + secret[:-1].encode(),
                      b"Bearer \xff\xfe"):
            r = await c.post(CHAT, content=BODY, headers={**JSON, "Authorization": wrong})  # type: ignore[dict-item]
            assert r.status_code == 401, wrong


# -- a real browser on another origin ------------------------------------------------

ATTACK = """<!doctype html><title>attack</title><script>
const target = %(target)r;
const body = JSON.stringify({messages: [{role: "user", content: "pwned"}]});
Promise.allSettled([
  fetch(target + "/admin/drain", {method: "POST", mode: "no-cors"}),
  fetch(target + "/v1/chat/completions", {method: "POST", mode: "no-cors", body: body,
                                          headers: {"Content-Type": "text/plain"}}),
  fetch(target + "/v1/chat/completions", {method: "POST", mode: "no-cors", body: new Blob([body])}),
  fetch(target + "/v1/chat/completions", {method: "POST", mode: "cors", body: body,
                                          headers: {"Content-Type": "application/json"}}),
]).then(results => { document.title = "done " + results.map(r => r.status).join(","); });
</script>"""


@pytest.fixture
def attacker_page() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on another port serving :data:`ATTACK` (the target set per test)."""
    pages: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = pages[-1].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/attack.html", pages
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_page_on_another_origin_can_neither_drain_nor_generate(echo_model_dir: Path, browser: Any,
                                                                  attacker_page: tuple[str, list[str]]) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.http.fuzz_helpers import serve_in_thread

    page, pages = attacker_page
    with serve_in_thread(echo_model_dir, "attacked", warmup=False) as srv:
        pages.append(ATTACK % {"target": srv.url})
        browser.get(page)
        WebDriverWait(browser, 30, poll_frequency=0.05).until(lambda b: b.title.startswith("done"))
        health = httpx.get(srv.url + "/health").json()
        assert health["status"] == "ok", health
        assert srv.statistics().requests_total == 0
