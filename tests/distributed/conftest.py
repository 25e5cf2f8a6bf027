"""Two-rank groups on loopback (MLX's ring back-end) serving the random test models."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.process import LoggedProcess

RANK = Path(__file__).with_name("_rank.py")
BACKEND_ERRORS = ("Couldn't bind", "You need to provide", "no distributed back-end")


def make_diverse_model(out: Path, kind: str) -> Path:
    """A random model whose greedy tokens vary (``make_random_model``'s, with
    stronger layers and its own untied head): ``qwen3`` (tensor parallel) or
    ``qwen2`` (mlx-lm's qwen2 also has pipeline parallelism)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    from afm_core.testing import make_random_model

    make_random_model(out, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2)
    config = json.loads((out / "config.json").read_text())
    if kind == "qwen2":
        config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
        config.pop("head_dim")
        mx.random.seed(1)
        weights = dict(tree_flatten(qwen2.Model(qwen2.ModelArgs.from_dict(config)).parameters()))
    else:
        weights = dict(mx.load(str(out / "model.safetensors")))
    config["tie_word_embeddings"] = False
    mx.random.seed(2)
    weights = {k: v * 3.0 if "layers" in k and v.ndim == 2 else v for k, v in weights.items()}
    weights["lm_head.weight"] = mx.random.normal((config["vocab_size"], config["hidden_size"])) * 0.5
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="session")
def tp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_diverse_model(tmp_path_factory.mktemp("tp-model"), "qwen3")


@pytest.fixture(scope="session")
def pp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_diverse_model(tmp_path_factory.mktemp("pp-model"), "qwen2")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Rank(LoggedProcess):
    """One rank's process (``_rank.py``); stderr lines collected by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        super().__init__([sys.executable, str(RANK), *argv], env)


class Group:
    """``afm serve --distributed MODE`` on two ranks over loopback; rank 0's URL in ``url``."""

    def __init__(self, tmp: Path, model: Path, mode: str, *extra: str):
        ports = _free_ports(2)
        hostfile = tmp / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        argv = ["--model", str(model), "--port", "0", "--quiet", "--distributed", mode, *extra]
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "PYTHONUNBUFFERED": "1"}
        self.ranks = [Rank(argv, {**env, "MLX_RANK": str(r)}) for r in range(2)]
        found = self.ranks[0].wait_for(r"serving .* on (http://127\.0\.0\.1:\d+)", timeout=120)
        if found is None:
            self.close()
            log = self.ranks[0].log() + self.ranks[1].log()
            if any(e in log for e in BACKEND_ERRORS):
                pytest.skip(f"mx.distributed's ring back-end is unavailable here: {log.strip()[-300:]}")
            raise AssertionError(f"the group did not start:\n{log}")
        self.url = found.group(1)

    def stop(self) -> list[int | None]:
        """SIGTERM rank 0 (rank 1 must end on its own); both exit statuses."""
        leader, follower = self.ranks
        if leader.proc.poll() is None:
            leader.proc.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for rank in (leader, follower):
            try:
                codes.append(rank.proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.close()
        return codes

    def close(self) -> None:
        for rank in self.ranks:
            rank.kill()


def skip_without_distributed() -> None:
    import mlx.core as mx

    if not mx.distributed.is_available():
        pytest.skip("this MLX build has no distributed back-end (mx.distributed.is_available() is False)")


@pytest.fixture
def group_factory(tmp_path: Path) -> Iterator[Any]:
    """Start groups in a test; each is closed (killed) at the end."""
    skip_without_distributed()
    made: list[Group] = []

    def start(model: Path, mode: str, *extra: str) -> Group:
        sub = tmp_path / f"group{len(made)}"
        sub.mkdir()
        group = Group(sub, model, mode, *extra)
        made.append(group)
        return group

    yield start
    for group in made:
        group.close()
