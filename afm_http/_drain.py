"""Draining a replica: out of rotation at once, running streams finish, then the rest end.

A replica behind a load balancer is restarted without losing a request in
three moves: it stops looking ready, it stops taking new work, and it gives
the streams it runs a bounded time to finish.  :class:`Drain` is that state
for one app; it begins on SIGTERM when ``afm serve --drain-timeout S`` is
above 0 (``serve_engine(..., drain_trigger=...)``) or on ``POST /admin/drain``
(``DELETE /admin/drain`` ends an admin drain).  While it lasts:

* ``GET /health`` answers 503 with ``"status": "draining"`` (the balancer's
  health check takes the replica out of rotation);
* new work (:data:`GENERATION_PATHS`: generation, embeddings, tokenizing) gets 503 in its API's
  envelope with ``Retry-After`` (the hook in ``_routes/health.py``), which HAProxy retries on
  another replica (``retry-on 503``); cancel, ``GET`` and the other routes
  still work, so a client can still cancel a stream running here;
* running streams go on until :attr:`Drain.deadline`; then :meth:`Drain.enforce`
  cancels what is left (``finish_reason: "cancelled"``, then ``[DONE]``).

``--drain-timeout 0`` (the default) keeps the older behaviour on SIGTERM:
stop listening and cancel every open stream at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

__all__ = ["GENERATION_PATHS", "Drain", "DrainStatus"]

log = logging.getLogger("afm.http")

GENERATION_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/embeddings",
    "/api/chat", "/api/generate", "/api/embed", "/api/embeddings",
    "/tokenize", "/detokenize", "/v1/chat/completions/count_tokens", "/v1/messages/count_tokens",
    "/v1/responses/input_tokens", "/v1/responses/compact",
})
"""``POST`` routes that start engine work (generating, embedding, templating or
tokenizing): refused while draining.  Everything else (cancel routes,
``GET``s) is still served."""

RETRY_AFTER_SECONDS = 1
"""``Retry-After`` on a refusal: through a balancer the retry lands on another replica."""


@dataclass(frozen=True, slots=True)
class DrainStatus:
    """What ``/health`` says about a drain (see :meth:`Drain.status`)."""

    reason: str
    """``"shutdown"`` (a signal: the process exits once drained) or ``"admin"``."""
    seconds: float
    """Since the drain began."""
    remaining: float | None
    """Seconds until the streams still running are cancelled (None: no limit; 0: done)."""

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "seconds": round(self.seconds, 3),
                "cancel_in_seconds": None if self.remaining is None else round(self.remaining, 3)}


class Drain:
    """One app's drain state: serving (the default) or draining until a deadline."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._deadline = math.inf
        self._reason = ""
        self._epoch = 0  # bumped on every change, so enforce() re-reads the deadline
        self._enforced = -1  # the epoch whose deadline enforce() already acted on
        self._changed = trio.lowlevel.ParkingLot()

    @property
    def active(self) -> bool:
        """True while draining: not ready, new generation requests refused."""
        return self._since is not None

    @property
    def shutting_down(self) -> bool:
        """True when the drain ends in the process stopping (a signal, not an admin call)."""
        return self._reason == "shutdown"

    @property
    def deadline(self) -> float:
        """``trio.current_time()`` at which running streams are cancelled (``inf``: none)."""
        return self._deadline

    def start(self, timeout: float, reason: str) -> None:
        """Begin draining (or go on, keeping the earlier deadline): running streams
        get ``timeout`` seconds (``inf``: no limit) before they are cancelled."""
        now = trio.current_time()
        if self._since is None:
            self._since = now
            log.info("draining (%s): not ready, refusing new requests; open streams get %s", reason,
                     "no time limit" if math.isinf(timeout) else f"{timeout:g} s")
        self._deadline = min(self._deadline, now + timeout)
        if reason == "shutdown" or not self._reason:
            self._reason = reason
        self._bump()

    def resume(self) -> bool:
        """End an admin drain (ready again); False during a shutdown or when not draining."""
        if self._since is None or self.shutting_down:
            return False
        self._since, self._deadline, self._reason = None, math.inf, ""
        log.info("drain ended: ready")
        self._bump()
        return True

    def status(self) -> DrainStatus | None:
        """The drain as ``/health`` reports it, None when not draining."""
        if self._since is None:
            return None
        now = trio.current_time()
        remaining = None if math.isinf(self._deadline) else max(0.0, self._deadline - now)
        return DrainStatus(self._reason, now - self._since, remaining)

    async def enforce(self, cancel_open: Callable[[], int]) -> None:
        """Run for the app's life: when a drain's deadline passes, ``cancel_open()``
        (which cancels every open request and returns how many)."""
        while True:
            epoch = self._epoch
            pending = self.active and self._enforced != epoch
            with trio.move_on_at(self._deadline if pending else math.inf):
                await self._changed.park()
                continue
            if self._epoch == epoch:
                self._enforced = epoch  # once per deadline: a later straggler finishes
                n = cancel_open()
                log.info("drain deadline: cancelled %d open request(s)", n)

    def _bump(self) -> None:
        self._epoch += 1
        self._changed.unpark_all()
