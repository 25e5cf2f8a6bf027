"""Real ``afm serve`` replicas behind a real HAProxy, on loopback (tests and benchmarks).

:class:`Cluster` starts ``n`` replicas as subprocesses on free ports and an
``haproxy`` (foreground, its log in a file) with the configuration
``afm deploy haproxy`` renders for them; :meth:`Cluster.close` stops all of
it.  Replicas can be drained (SIGTERM), killed (SIGKILL) and restarted on
the same port; :meth:`Balancer.states` reads each server's status from the
stats page.  Nothing here asserts: the tests and benchmarks decide.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from afm_http._deploy_cli import Replica, render

__all__ = ["Balancer", "Cluster", "ReplicaProcess", "free_port", "haproxy_binary"]

HOST = "127.0.0.1"


def haproxy_binary() -> str | None:
    return shutil.which("haproxy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait(predicate, timeout: float, what: str, interval: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} (after {timeout:g} s)")
        time.sleep(interval)


class ReplicaProcess:
    """One ``afm serve`` subprocess on a fixed port (so a restart keeps its address)."""

    def __init__(self, name: str, model: Path, port: int, log_dir: Path, args: tuple[str, ...],
                 env: dict[str, str] | None = None) -> None:
        self.name, self.model, self.port, self.args = name, model, port, args
        self.env = env or {}
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self.starts += 1
        log = self.log_path.open("ab")
        log.write(f"--- start {self.starts}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "afm_core._cli", "serve", "--model", str(self.model),
             "--host", HOST, "--port", str(self.port), "--quiet", *self.args],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **self.env})
        log.close()

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log()}")
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(ready, timeout, f"{self.name} ready", 0.1)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


class Balancer:
    """A foreground ``haproxy`` with the rendered configuration."""

    def __init__(self, replicas: list[ReplicaProcess], work: Path, **render_args: object) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.config_path = work / "haproxy.cfg"
        self.log_path = work / "haproxy.log"
        text = render([Replica(r.name, HOST, r.port) for r in replicas],
                      bind=f"{HOST}:{self.port}", admin_bind=f"{HOST}:{self.admin_port}",
                      **render_args)  # type: ignore[arg-type]
        self.config_path.write_text(text)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin_port}"

    def check(self) -> subprocess.CompletedProcess[str]:
        binary = haproxy_binary()
        assert binary is not None
        return subprocess.run([binary, "-c", "-f", str(self.config_path)], capture_output=True,
                              text=True, check=False)

    def start(self) -> None:
        binary = haproxy_binary()
        assert binary is not None
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([binary, "-db", "-f", str(self.config_path)],
                                         stdout=log, stderr=subprocess.STDOUT)

    def states(self) -> dict[str, str]:
        """Each server of the balanced backend: ``UP``, ``DOWN``, ``UP 1/2``, ..."""
        text = httpx.get(self.admin_url + "/stats;csv", timeout=5).text.lstrip("# ")
        return {row["svname"]: row["status"] for row in csv.DictReader(io.StringIO(text))
                if row["pxname"] == "afm_replicas" and row["svname"] not in ("FRONTEND", "BACKEND")}

    def wait_state(self, name: str, state: str, timeout: float = 30) -> float:
        """Wait until server ``name`` is ``state`` (``UP`` or ``DOWN``); the seconds it took."""
        t0 = time.monotonic()

        def reached() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited:\n{self.log()}")
            try:
                return self.states().get(name) == state
            except httpx.HTTPError:
                return False

        _wait(reached, timeout, f"haproxy: {name} {state}", 0.05)
        return time.monotonic() - t0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


class Cluster:
    """``n`` replicas of ``model`` behind one HAProxy (use as a context manager)."""

    def __init__(self, model: Path, work: Path, n: int = 3, *, replica_args: tuple[str, ...] = (),
                 replica_env: dict[str, str] | None = None, **render_args: object) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.replicas = [ReplicaProcess(f"r{i}", model, free_port(), work, replica_args, replica_env)
                         for i in range(1, n + 1)]
        self.balancer = Balancer(self.replicas, work, **render_args)

    def __enter__(self) -> Cluster:
        try:
            for r in self.replicas:
                r.start()
            for r in self.replicas:
                r.wait_ready()
            self.balancer.start()
            for r in self.replicas:
                self.balancer.wait_state(r.name, "UP")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.balancer.stop()
        for r in self.replicas:
            r.stop()

    def replica(self, name: str) -> ReplicaProcess:
        return next(r for r in self.replicas if r.name == name)

    def ensure_up(self) -> None:
        """Restart any replica that is not running and wait until HAProxy has all UP."""
        for r in self.replicas:
            if not r.alive():
                r.start()
                r.wait_ready()
        for r in self.replicas:
            self.balancer.wait_state(r.name, "UP")

    def idle(self) -> dict[str, dict]:
        """Each live replica's ``/health`` counts (running, waiting, registered, held)."""
        out = {}
        for r in self.replicas:
            if r.alive():
                h = r.health()
                out[r.name] = {k: h[k] for k in ("running", "waiting", "requests_active", "inflight")}
        return out
