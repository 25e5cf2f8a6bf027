"""Serving: ``afm serve`` as a process, the CLI defaults, graceful shutdown."""

from __future__ import annotations

import json
import re
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest
import trio

from afm_core import open_engine
from afm_core._cli import build_parser
from afm_http import ServerConfig, serve_engine
from tests.process import LoggedProcess

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "word " * 4000}], "stream": True}


def test_cli_defaults_are_safe() -> None:
    args = build_parser("serve").parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 9999
    assert args.api_key is None and args.cors_origin == [] and args.model is None
    assert args.max_body_bytes == 8 << 20
    assert args.embedding_pooling == "mean"
    assert build_parser("serve").parse_args(
        ["serve", "--embedding-pooling", "last"]).embedding_pooling == "last"
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--embedding-pooling", "max"])
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--max-batch", "0"])
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--port", "70000"])


def test_cli_kv_bits(capsys: pytest.CaptureFixture[str]) -> None:
    from afm_http._serve_cli import _engine_config, run

    args = build_parser("serve").parse_args(["serve"])
    assert (args.kv_bits, args.kv_group_size) == (None, 64)
    args = build_parser("serve").parse_args(["serve", "--kv-bits", "4", "--kv-group-size", "32"])
    config = _engine_config(args)
    assert (config.kv_bits, config.kv_group_size) == (4, 32)
    for bad in (["--kv-bits", "3"], ["--kv-bits", "16"], ["--kv-bits", "8", "--kv-group-size", "48"]):
        with pytest.raises(SystemExit):
            build_parser("serve").parse_args(["serve", *bad])
        assert "invalid choice" in capsys.readouterr().err
    args = build_parser("serve").parse_args(["serve", "--kv-bits", "8", "--distributed", "tensor"])
    assert run(args) == 1
    assert "--kv-bits cannot be used with --distributed" in capsys.readouterr().err


class _Server(LoggedProcess):
    """``afm serve`` in a subprocess; stderr lines collected by a thread."""

    def __init__(self, *argv: str) -> None:
        super().__init__([sys.executable, "-m", "afm_core._cli", "serve", "--quiet", *argv])

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        m = super().wait_for(pattern, timeout)
        if m is None:
            raise AssertionError("server exited:\n" + self.log())
        return m


def test_afm_serve_process_sigterm_ends_open_stream_cleanly(echo_model_dir: Path) -> None:
    server = _Server("--model", str(echo_model_dir), "--port", "0", "--api-key", "k3y")
    try:
        url = server.wait_for(r"serving .* on (http://127\.0\.0\.1:\d+)").group(1)
        # the compute back-ends, from afm_core.runtime_info(), just before
        assert any(re.match(r"afm: BLAS: \S.*; quantized products: (afm kernel \(.+\)|MLX kernel)$", line)
                   for line in server.seen)
        auth = {"Authorization": "Bearer k3y"}
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers=auth).json()["data"][0]["context_length"] == 32768
            data = []
            with c.stream("POST", CHAT, json=LONG, headers=auth) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data.append(line[6:])
                        if len(data) == 3:
                            server.proc.send_signal(signal.SIGTERM)
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["choices"][0]["finish_reason"] == "cancelled"
        assert server.proc.wait(timeout=60) == 0
        server.wait_for("SIGTERM: shutting down")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_afm_serve_port_in_use_exits_1(echo_model_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = _Server("--model", str(echo_model_dir), "--port", str(port))
        assert server.proc.wait(timeout=120) == 1
        server.wait_for(f"cannot listen on 127.0.0.1:{port}")


async def test_shutdown_trigger_cancels_open_streams(echo_model_dir: Path) -> None:
    stop = trio.Event()
    data: list[str] = []
    with trio.fail_after(60):  # serve_engine must return by itself once triggered
        await _serve_until_triggered(echo_model_dir, stop, data)
    assert stop.is_set()


async def _serve_until_triggered(model: Path, stop: trio.Event, data: list[str]) -> None:
    async with open_engine(model) as engine, trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve_engine(
            engine, host="127.0.0.1", port=0, server=ServerConfig(), quiet=True,
            shutdown_trigger=stop.wait, task_status=task_status))
        async with httpx.AsyncClient(base_url=binds[0]) as c, \
                c.stream("POST", CHAT, json=LONG, headers={"X-Request-ID": "at-shutdown"}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    data.append(line[6:])
                    if len(data) == 3:
                        stop.set()
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["choices"][0]["finish_reason"] == "cancelled"
        with trio.fail_after(30):
            while engine.statistics().requests_active:
                await trio.sleep(0.01)
