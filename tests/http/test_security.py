"""Error paths and security defaults end to end: auth, CORS, body limits, ids, SDK errors."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import trio

from afm_http import ServerConfig
from afm_http.testing import running_server

CHAT = "/v1/chat/completions"
OK_BODY = b'{"messages": [{"role": "user", "content": "fine"}]}'
JSON = {"Content-Type": "application/json"}  # (without a key a body must say it is JSON)


def envelope_of(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert r.headers["x-request-id"] == r.headers["openai-request-id"]
    return err


async def raw_exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection, read until the server closes it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        try:
            await stream.send_all(data)
        except trio.BrokenResourceError:
            pass  # the server answered and closed before reading everything
        out = b""
        with trio.fail_after(20):
            while chunk := await stream.receive_some(65536):
                out += chunk
        return out


async def test_every_route_but_health_needs_the_key(echo_model_dir: Path) -> None:
    cfg = ServerConfig(api_key="s3cret")
    async with running_server(echo_model_dir, server=cfg) as (url, engine), \
            httpx.AsyncClient(base_url=url, headers=JSON) as c:
        routes = [("GET", "/v1/models"), ("GET", f"/v1/models/{engine.model_id}"), ("GET", "/metrics"),
                  ("POST", CHAT), ("POST", f"{CHAT}/x/cancel"), ("GET", "/nope"), ("DELETE", CHAT)]
        for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                    {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer s3cret2"}):
            for method, path in routes:
                r = await c.request(method, path, headers=bad, content=OK_BODY)
                assert r.status_code == 401, (method, path, bad)
                assert envelope_of(r)["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.headers["x-should-retry"] == "false"  # a wrong key stays wrong
        assert (await c.get("/health")).status_code == 200
        good = {"Authorization": "Bearer s3cret"}
        r = await c.post(CHAT, content=OK_BODY, headers=good)
        assert r.json()["choices"][0]["message"]["content"] == "fine"
        assert (await c.get("/nope", headers=good)).status_code == 404
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
        await client.close()


async def test_cors_off_by_default_and_exact_when_configured(echo_model_dir: Path) -> None:
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url, headers=JSON) as c:
        for r in (await c.options(CHAT, headers=preflight),
                  await c.post(CHAT, content=OK_BODY, headers={"Origin": "http://evil.example"})):
            assert not any(h.startswith("access-control-") for h in r.headers)
    cfg = ServerConfig(cors_origins=("http://app.example",), api_key="k")
    async with running_server(echo_model_dir, server=cfg) as (url, _), \
            httpx.AsyncClient(base_url=url, headers=JSON) as c:
        r = await c.options(CHAT, headers={**preflight, "Origin": "http://app.example"})
        assert r.status_code == 200  # preflights carry no credentials
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = await c.post(CHAT, content=OK_BODY, headers={"Origin": "http://app.example",
                                                          "Authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        assert "X-Request-ID" in r.headers["access-control-expose-headers"]
        r = await c.options("/v1/responses/resp_1", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "DELETE"})
        assert r.status_code == 200 and "DELETE" in r.headers["access-control-allow-methods"]
        r = await c.options(CHAT, headers=preflight)
        assert "access-control-allow-origin" not in r.headers


async def test_body_limits_chunked_and_declared(echo_model_dir: Path) -> None:
    cfg = ServerConfig(max_body_bytes=1000)
    async with running_server(echo_model_dir, server=cfg) as (url, engine), \
            httpx.AsyncClient(base_url=url, headers=JSON) as c:
        r = await c.post(CHAT, content=b" " * 1001 + OK_BODY)
        assert r.status_code == 413 and envelope_of(r)["code"] == "request_too_large"

        async def chunks():
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(50):
                yield b"x" * 100
            yield b'"}]}'

        r = await c.post(CHAT, content=chunks())
        assert r.status_code == 413 and r.headers["connection"] == "close"
        # raw: the server answers early and closes instead of hanging on the unread body
        port = int(url.rsplit(":", 1)[1])
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        out = await raw_exchange(port, head + b"64\r\n" + b"x" * 100 + b"\r\n" * 1 +
                                 (b"64\r\n" + b"x" * 100 + b"\r\n") * 40)
        assert out.startswith(b"HTTP/1.1 413")
        r = await c.post(CHAT, content=OK_BODY)
        assert r.status_code == 200
        assert engine.statistics().requests_active == 0


async def test_request_id_cannot_inject(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url, headers=JSON) as c:
        for bad in ("a" * 129, "has space", 'quote"d', "semi;colon", "slash/y", "-leading", "tab\tx"):
            r = await c.post(CHAT, content=OK_BODY, headers={"X-Request-ID": bad})
            assert r.status_code == 400 and envelope_of(r)["param"] == "X-Request-ID", bad
            assert r.headers["x-request-id"].startswith("req_")
        port = int(url.rsplit(":", 1)[1])
        out = await raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                       b"X-Request-ID: ok\xc3\xa9\r\n\r\n")
        head = out.split(b"\r\n\r\n", 1)[0].lower()
        assert out.startswith(b"HTTP/1.1 400") and b"\xc3" not in head
        r = await c.post(CHAT, content=OK_BODY, headers={"X-Request-ID": "Good.id_1:2-3"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "Good.id_1:2-3"


@pytest.mark.parametrize("payload", [
    b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
    b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}}',
    b'{"messages": [{"role": "user"}], "tools": {"type": "function"}}',
    b'{"messages": "hello"}',
    b'{"messages": [{"role": "user", "content": "x"}], "stop": [""]}',
    b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}',
    b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}',
    b"",
    b"null",
    b'"just a string"',
])
async def test_malformed_requests_are_400_never_500(echo_model_dir: Path, payload: bytes) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url, headers=JSON) as c:
        r = await c.post(CHAT, content=payload, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        envelope_of(r)
        assert (await c.post(CHAT, content=OK_BODY)).status_code == 200


async def test_sdk_sees_typed_errors(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url, headers=JSON) as c:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="m", messages=[])
        assert info.value.status_code == 400 and info.value.param == "messages"
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], n=17)
        with pytest.raises(openai.BadRequestError) as ctx_info:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
        assert ctx_info.value.code == "context_length_exceeded"
        async with c.stream("POST", CHAT, json={"messages": [{"role": "user", "content": "w " * 3000}],
                                                "stream": True}, headers={"X-Request-ID": "held"}) as r:
            lines = r.aiter_lines()  # kept alive: a dropped iterator closes the connection
            await lines.__anext__()
            with pytest.raises(openai.ConflictError):
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}],
                    extra_headers={"X-Request-ID": "held"})
            assert (await c.post(f"{CHAT}/held/cancel")).status_code == 200
        await client.close()
