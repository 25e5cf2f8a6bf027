"""One stream's undelivered events, between the engine's hand-off and its reader.

The engine appends each step's events without blocking (the generation
thread must never wait for a reader); the reader takes everything that
arrived since its last look as one batch.  A reader that falls behind
therefore costs one list of events, not one queued item per engine step, and
catches up in a single write.  What it can hold is bounded by the request's
``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio

from .._stream.events import Event

__all__ = ["Mailbox"]


class Mailbox:
    """Single-reader event buffer; ``put`` and ``close`` run in Trio, never block."""

    __slots__ = ("_closed", "_events", "_reader")

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._closed = False
        self._reader: trio.lowlevel.Task | None = None

    def put(self, events: Iterable[Event]) -> None:
        """Append ``events`` and wake the reader; ignored once closed."""
        if self._closed:
            return
        self._events.extend(events)
        self._wake()

    def close(self) -> None:
        """No more events: the reader drains what is left, then sees the end."""
        self._closed = True
        self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    async def take(self) -> tuple[Event, ...] | None:
        """Everything not yet taken, waiting for at least one event; ``None`` at the end."""
        if self._reader is not None:
            raise trio.BusyResourceError("another task is already reading this stream")
        if self._events or self._closed:
            await trio.lowlevel.checkpoint()
        while not self._events:
            if self._closed:
                return None
            self._reader = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self._reader = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        batch = tuple(self._events)
        self._events.clear()
        return batch

    def _wake(self) -> None:
        task, self._reader = self._reader, None
        if task is not None:
            trio.lowlevel.reschedule(task)
