"""The chat page's files over HTTP (no browser): served at / and /ui/*, without the
API key, with a strict CSP; packaged; off with ServerConfig(ui=False) / --no-ui."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx

import afm_http
from afm_http import ServerConfig
from afm_http._routes.ui import ASSETS
from afm_http._serve_cli import add_arguments
from afm_http.testing import running_server


async def test_page_and_assets_served_without_the_key(echo_model_dir: Path) -> None:
    config = ServerConfig(api_key="sekret")
    async with running_server(echo_model_dir, server=config, warmup=False) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        r = await c.get("/")
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/html; charset=utf-8"
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
        assert 'src="ui/chat.js"' in r.text and 'href="ui/chat.css"' in r.text
        for name in ("chat.js", "chat.css"):
            r = await c.get(f"/ui/{name}")
            assert r.status_code == 200 and r.headers["content-type"] == ASSETS[name]
        assert (await c.head("/")).status_code == 200
        r = await c.get("/ui/secret.txt")
        assert r.status_code == 404 and r.json()["error"]["message"]
        # the API itself still needs the key; the page's files never carried it
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.post("/", json={})).status_code in (401, 405)
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200


async def test_no_ui_is_404_as_before(echo_model_dir: Path) -> None:
    config = ServerConfig(ui=False)
    async with running_server(echo_model_dir, server=config, warmup=False) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        r = await c.get("/")
        assert r.status_code == 404 and r.json()["error"]["message"]
        assert (await c.get("/ui/chat.js")).status_code == 404
    keyed = ServerConfig(ui=False, api_key="k")
    async with running_server(echo_model_dir, server=keyed, warmup=False) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        assert (await c.get("/")).status_code == 401  # no exemption when the page is off


def test_no_ui_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).no_ui is False
    assert parser.parse_args(["--no-ui"]).no_ui is True
    assert ServerConfig().ui is True


def test_files_are_in_the_package() -> None:
    static = Path(afm_http.__file__).parent / "static"
    assert {p.name for p in static.iterdir()} >= set(ASSETS)
    js = (static / "chat.js").read_text()
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js
