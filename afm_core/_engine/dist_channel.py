"""The distributed group's wiring, shared by rank 0 (:mod:`.distributed`) and
the other ranks (:mod:`.follower`): joining the group, the frames rank 0
broadcasts (:class:`Channel`), the watchdog over every collective section
(:class:`Watchdog`), rank 0's journal (:class:`Link`), and the generator
settings and model digest both ends agree on.  See :mod:`.distributed`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .._errors import DistributedError

__all__ = ["Channel", "Link", "Op", "Watchdog", "config_digest", "generator_settings", "init_group", "lost_connection"]

HEAD = 1024
"""Bytes of a frame's first broadcast (a longer frame takes a second one)."""
PREFIX_KEY = "model"
"""The follower's prefix-cache key (it serves one model)."""

Op = list[Any]
"""One journal entry: ``[name, *arguments]`` (see :mod:`.distributed`)."""


def init_group(backend: str = "any") -> Any:
    """This process's ``mx.distributed`` group, joined on the first call;
    :class:`DistributedError` when there is none of at least 2 ranks."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        raise DistributedError("this MLX build has no distributed back-end")
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        raise DistributedError(
            f"could not join the distributed group ({exc}); start every rank with mlx.launch "
            "(see docs/distributed.md), or set MLX_RANK and MLX_HOSTFILE on each") from exc
    if group.size() < 2:
        raise DistributedError("a distributed model needs at least 2 ranks; this group has 1")
    return group


def lost_connection(exc: BaseException) -> DistributedError:
    return DistributedError(f"lost the connection to another rank of the distributed group ({exc})")


class Channel:
    """Frames from rank 0 to every rank, as ``all_sum`` broadcasts on
    ``stream`` (the generation stream: MLX runs one stream's operations in
    order, so broadcasts and the model's collectives keep their order)."""

    def __init__(self, group: Any, stream: Any):
        import mlx.core as mx
        import numpy as np

        self.mx, self.np = mx, np
        self.group = group
        self.stream = stream

    def _sum(self, data: Any) -> Any:
        mx = self.mx
        out = mx.distributed.all_sum(mx.array(data), group=self.group, stream=self.stream)
        mx.eval(out)
        return out

    def send(self, payload: bytes) -> None:
        """Rank 0: broadcast ``payload``."""
        np = self.np
        head = np.zeros(HEAD, dtype=np.uint8)
        first = payload[: HEAD - 8]
        head[:8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
        head[8 : 8 + len(first)] = np.frombuffer(first, dtype=np.uint8)
        self._sum(head)
        if len(payload) > HEAD - 8:
            self._sum(np.frombuffer(payload[HEAD - 8 :], dtype=np.uint8))

    def recv(self) -> bytes:
        """Another rank: the payload rank 0 broadcasts."""
        np = self.np
        head = np.array(self._sum(np.zeros(HEAD, dtype=np.uint8)), copy=False)
        size = int.from_bytes(head[:8].tobytes(), "little")
        data = head[8 : 8 + min(size, HEAD - 8)].tobytes()
        if size > HEAD - 8:
            data += np.array(self._sum(np.zeros(size - (HEAD - 8), dtype=np.uint8))).tobytes()
        return data


class Watchdog:
    """Calls ``on_timeout(what, seconds)`` once, from its own thread, when one
    :meth:`guard` section has lasted ``timeout`` seconds."""

    def __init__(self, timeout: float, on_timeout: Callable[[str, float], None]):
        self.timeout = timeout
        self.on_timeout = on_timeout
        self.tripped = False
        self._what: str | None = None
        self._since = 0.0
        self._depth = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="afm-distributed-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Time the block (the outermost of nested ones)."""
        if self._depth == 0:
            self._what, self._since = what, time.monotonic()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._what = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        tick = min(0.25, self.timeout / 4)
        while not self._closed.wait(tick):
            what, since = self._what, self._since
            waited = time.monotonic() - since
            if what is not None and waited > self.timeout:
                self.tripped = True
                self.on_timeout(what, waited)
                return


class Link:
    """Rank 0's end: the journal of batch operations and the channel that
    broadcasts it (see :mod:`.distributed`)."""

    def __init__(self, channel: Channel, watchdog: Watchdog, broken: Callable[[DistributedError], None]):
        self.channel = channel
        self.watchdog = watchdog
        self.broken = broken
        self.ops: list[Op] = []
        self.failed: DistributedError | None = None

    def record(self, op: Op) -> None:
        self.ops.append(op)

    def flush(self, last: Op | None, what: str) -> None:
        """Broadcast the journal, ending with ``last`` (which rank 0 runs next)."""
        if self.failed is not None:
            raise self.failed
        ops, self.ops = self.ops, []
        if last is not None:
            ops.append(last)
        payload = json.dumps(ops, separators=(",", ":")).encode()
        try:
            with self.watchdog.guard(what):
                self.channel.send(payload)
        except RuntimeError as exc:
            raise self.fail(lost_connection(exc)) from exc

    @contextmanager
    def running(self, what: str) -> Iterator[None]:
        """Run the block (model work with collectives) under the watchdog."""
        if self.failed is not None:
            raise self.failed
        try:
            with self.watchdog.guard(what):
                yield
        except RuntimeError as exc:
            raise self.fail(lost_connection(exc)) from exc

    def fail(self, err: DistributedError) -> DistributedError:
        if self.failed is None:
            self.failed = err
            self.broken(err)
        return self.failed


def generator_settings(*, max_batch: int, prefill_batch: int, prefill_step: int,
                       eos: list[int], stream: Any) -> dict[str, Any]:
    """``EngineBatchGenerator``'s arguments, as :meth:`Worker.setup` gives them."""
    return {
        "max_tokens": 1 << 30,
        "stop_tokens": [[t] for t in eos],
        "completion_batch_size": max_batch,
        "prefill_batch_size": min(prefill_batch, max_batch),
        "prefill_step_size": prefill_step,
        "stream": stream,
    }


def config_digest(path: Path) -> str:
    try:
        return hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        return ""
