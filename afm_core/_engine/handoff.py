"""Each engine step's outputs, from the generation thread to Trio.

The thread calls :meth:`Handoff.post` once per step; it appends the outputs to
a lock-guarded pending list and, unless one is already scheduled, schedules
one Trio callback (``run_sync_soon``) that dispatches everything posted since.
A busy Trio side so gets one wake-up per drain, not one per step (each
stream's mailbox coalesces what arrives meanwhile).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import trio

from .commands import Outputs


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
