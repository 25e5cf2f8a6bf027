"""``afm deploy haproxy``: the rendered configuration, the shipped example, the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from afm_core._cli import main
from afm_http._deploy_cli import Replica, parse_replica, render

from .cluster import haproxy_binary

SHIPPED = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "afm.cfg"
SHIPPED_REPLICAS = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]


def test_shipped_config_is_the_rendered_one() -> None:
    """deploy/haproxy/afm.cfg is `afm deploy haproxy` for three local replicas (regenerate it
    with the command in its header when the template changes)."""
    replicas = [parse_replica(r, i) for i, r in enumerate(SHIPPED_REPLICAS, 1)]
    assert SHIPPED.read_text() == render(replicas)


def test_the_routing_rules_are_there() -> None:
    text = render([Replica("a", "10.0.0.1", 8001), Replica("b", "10.0.0.2", 8001)])
    for line in ("balance hash var(txn.afm_key)", "hash-type consistent",
                 "http-request set-header X-Request-ID %[unique-id] unless has_rid",
                 "http-request set-var(txn.afm_key) path,field(5,/) if cancel",
                 "stick match var(txn.afm_key) table afm_ids if cancel", "force-persist if cancel",
                 "option httpchk GET /health", "http-check expect status 200",
                 "default-server inter 1s fall 2 rise 1", "retry-on conn-failure empty-response 503",
                 "option abortonclose", "option http-buffer-request",
                 "server a 10.0.0.1:8001 id 1 check", "server b 10.0.0.2:8001 id 2 check"):
        assert line in text, line
    assert "compression" not in text.replace("'compression'", "")
    assert "frontend afm_admin" not in render([Replica("a", "h", 1)], admin_bind=None)


@pytest.mark.parametrize("text", ["nohost", "h:0", "h:70000", ":80", "1bad=h:80", "a b:80",
                                  "h:80/x"])
def test_bad_replicas_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_replica(text, 1)


def test_replica_forms() -> None:
    assert parse_replica("10.0.0.5:8001", 4) == Replica("r4", "10.0.0.5", 8001)
    assert parse_replica("gpu-a=mac1.lan:9999", 1) == Replica("gpu-a", "mac1.lan", 9999)
    assert parse_replica("[::1]:8001", 2).address == "[::1]:8001"
    with pytest.raises(ValueError, match="differ"):
        render([Replica("a", "h", 1), Replica("a", "h", 2)])


def test_cli_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "afm.cfg"
    assert main(["deploy", "haproxy", "--replica", "127.0.0.1:8001", "--replica",
                 "127.0.0.1:8002", "--bind", "0.0.0.0:80", "-o", str(out)]) == 0
    assert "bind 0.0.0.0:80" in out.read_text()
    assert main(["deploy", "haproxy", "--replica", "nope"]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err


@pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed (Debian: apt-get "
                    "install haproxy; macOS: brew install haproxy)")
def test_haproxy_accepts_the_shipped_config() -> None:
    check = subprocess.run([haproxy_binary() or "haproxy", "-c", "-f", str(SHIPPED)],
                           capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "Configuration file is valid" in check.stdout + check.stderr


def test_afm_lists_the_deploy_command() -> None:
    out = subprocess.run([sys.executable, "-m", "afm_core._cli", "deploy", "haproxy", "--help"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0 and "--replica" in out.stdout
