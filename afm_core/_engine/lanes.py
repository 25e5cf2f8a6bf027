"""Preparation work (templating, tokenizing) in worker threads: fair, bounded,
and stopped when nobody waits for it.

Every request is prepared off the Trio thread before it reaches the
generation thread; so are ``tokenize``, ``detokenize`` and the texts of
``embed``.  Done first come first served on one pool, two 8 MB ``/tokenize``
calls made a 3-token chat wait 19 s, and the work went on after its clients
had left.  :class:`Preparation` runs each piece of work:

* in one of two **lanes** chosen by its cost (the characters it will
  template or tokenize, :func:`text_cost`): work beyond :data:`LARGE_COST`
  takes the large lane (one thread), everything else the small lane
  (``EngineConfig.template_threads`` threads), so small requests never queue
  behind large ones, and large ones take at most one thread between them;
* with a :class:`Ticket` the work checks between its pieces (a long text is
  tokenized in pieces, :func:`afm_core._mlx.tokenizer.encode`): when the
  caller is cancelled (its client left) the ticket is cancelled and the work
  stops at its next check, freeing its lane; past ``prepare_timeout``
  seconds it stops with :class:`PrepareTimeoutError` (503, retry later);
  a ``budget`` of tokens stops a prompt as soon as it is known to be too
  long for the context, without tokenizing the rest.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from .._errors import EngineBusyError

__all__ = ["LARGE_COST", "Abandoned", "Preparation", "PrepareTimeoutError", "Ticket", "text_cost"]

T = TypeVar("T")

LARGE_COST = 64 << 10
"""Characters of text (about 16,000 tokens) past which work takes the large lane."""


class PrepareTimeoutError(EngineBusyError):
    """Preparing the request took longer than ``EngineConfig.prepare_timeout`` (503)."""

    code = "prepare_timeout"


class Abandoned(Exception):
    """The caller left: the work stops (raised in the worker thread, never seen by anyone)."""


class Ticket:
    """What a piece of preparation work checks between its pieces (thread-safe)."""

    def __init__(self, timeout: float = math.inf) -> None:
        self._cancelled = threading.Event()
        self._deadline = time.monotonic() + timeout
        self.timeout = timeout

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check(self, _count: int = 0) -> None:
        """Raise :class:`Abandoned` once cancelled, :class:`PrepareTimeoutError`
        past the deadline (``_count``: the tokens so far, for ``encode``'s callback)."""
        if self._cancelled.is_set():
            raise Abandoned
        if time.monotonic() > self._deadline:
            raise PrepareTimeoutError(f"preparing this request took longer than {self.timeout:g} s; "
                                      "retry later", retry_after=1.0)


def text_cost(value: Any) -> int:
    """The characters of every string in ``value`` (nested lists, tuples and
    dicts), plus one per item: what templating and tokenizing it costs."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
            total += len(item)
        elif isinstance(item, list | tuple):
            stack.extend(item)
            total += len(item)
        else:
            total += 1
    return total


class Preparation:
    """The two lanes of one engine (see the module docstring)."""

    def __init__(self, threads: int, *, timeout: float = math.inf, large_threads: int = 1) -> None:
        self.small = trio.CapacityLimiter(threads)
        self.large = trio.CapacityLimiter(large_threads)
        self.timeout = timeout
        self.abandoned = 0
        """Work stopped because its caller left (counted by the worker threads)."""
        self._lock = threading.Lock()

    def lane(self, cost: int) -> trio.CapacityLimiter:
        return self.large if cost > LARGE_COST else self.small

    async def run(self, fn: Callable[..., T], *args: Any, cost: int) -> T:
        """``fn(ticket, *args)`` in a worker thread of the lane for ``cost``;
        leaving (cancelled) stops it at its next ``ticket.check()``."""
        ticket = Ticket(self.timeout)

        def work() -> T:
            try:
                return fn(ticket, *args)
            except Abandoned:
                with self._lock:
                    self.abandoned += 1
                raise

        try:
            return await trio.to_thread.run_sync(work, limiter=self.lane(cost), abandon_on_cancel=True)
        finally:
            ticket.cancel()

    def statistics(self) -> dict[str, int]:
        """Threads busy and callers waiting in each lane."""
        return {"small_busy": int(self.small.borrowed_tokens), "small_waiting": self.small.statistics().tasks_waiting,
                "large_busy": int(self.large.borrowed_tokens), "large_waiting": self.large.statistics().tasks_waiting}
