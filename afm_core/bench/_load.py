"""A competing CPU load for ``afm bench --real-model --competing-load N``.

Issue 29 asks what oversubscription costs: afm's threads (MLX's scheduler,
OpenBLAS, the quantized kernels' pool) and llama.cpp's (a thread pool that
meets at a barrier after every operation) on cores another process wants
too.  :func:`competing_load` runs ``n`` processes that spin on the CPU (what
``stress --cpu N`` does, with nothing to install) for as long as the block
runs, and stops them after, also when the block fails or is cancelled.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.lowlevel

__all__ = ["SPIN", "competing_load"]

SPIN = "while True:\n    pass\n"
"""What each load process runs: one core's worth of work, no memory traffic."""


@asynccontextmanager
async def competing_load(n: int) -> AsyncIterator[list[int]]:
    """``n`` spinning processes (their pids) while the block runs; none for 0."""
    if n < 0:
        raise ValueError("competing load must be >= 0 processes")
    procs: list[trio.Process] = []
    try:
        for _ in range(n):
            procs.append(await trio.lowlevel.open_process(
                [sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        yield [p.pid for p in procs]
    finally:
        with trio.CancelScope(shield=True):
            for p in procs:
                p.kill()
            for p in procs:
                await p.wait()
