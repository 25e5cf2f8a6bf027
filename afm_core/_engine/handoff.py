"""What the generation thread hands back to Trio: each engine step's outputs
(:class:`Handoff`), and an embedding call's answer (:func:`embedding_answer`).

The thread calls :meth:`Handoff.post` once per step; it appends the outputs to
a lock-guarded pending list and, unless one is already scheduled, schedules
one Trio callback (``run_sync_soon``) that dispatches everything posted since.
A busy Trio side so gets one wake-up per drain, not one per step (each
stream's mailbox coalesces what arrives meanwhile).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from .._errors import EngineClosedError
from .commands import Embed, Outputs

if TYPE_CHECKING:
    from .worker import Worker


class Handoff:
    """``post`` (any thread) → ``dispatch`` (Trio, in order, one drain at a time)."""

    def __init__(self, token: trio.lowlevel.TrioToken, dispatch: Callable[[Outputs], None]):
        self._token = token
        self._dispatch = dispatch
        self._lock = threading.Lock()
        self._pending: list[Outputs] = []
        self._scheduled = False

    def post(self, outputs: Outputs) -> None:
        """(The generation thread.)  Queue one step's outputs for Trio; a
        Trio run that has ended takes nothing."""
        with self._lock:
            self._pending.append(outputs)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._token.run_sync_soon(self._drain)
        except trio.RunFinishedError:
            pass

    def _drain(self) -> None:
        """(Trio.)  Dispatch everything posted since the last drain."""
        with self._lock:
            batch = self._pending[:]
            self._pending.clear()
            self._scheduled = False
        for outputs in batch:
            self._dispatch(outputs)


async def embedding_answer(worker: Worker, token_lists: list[tuple[int, ...]], pooling: str,
                           waits: set[trio.Event]) -> list[list[float]] | BaseException:
    """Send one :class:`~.commands.Embed` command and wait for its answer (the
    vectors, or what computing them raised), which the generation thread hands
    back through ``done``; cancellable (the thread skips a command it has not
    started).  ``waits`` holds the waiting calls' events, which the engine sets
    when it stops: :class:`EngineClosedError` then."""
    trio_token = trio.lowlevel.current_trio_token()
    arrived = trio.Event()
    box: list[list[list[float]] | BaseException] = []

    def done(result: list[list[float]] | BaseException) -> None:  # on the generation thread
        box.append(result)
        try:
            trio_token.run_sync_soon(arrived.set)
        except trio.RunFinishedError:
            pass

    abandoned = threading.Event()
    waits.add(arrived)
    try:
        worker.embed(Embed(tuple(token_lists), pooling, done, abandoned))
        await arrived.wait()
    finally:
        abandoned.set()
        waits.discard(arrived)
    if not box:
        raise EngineClosedError("the engine stopped before the embeddings were computed")
    return box[0]
