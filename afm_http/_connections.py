"""How many connections one server keeps open, and which one gives way.

Every open connection holds a file descriptor; a process that runs out of
them cannot accept (``EMFILE``), so a few thousand idle or half-sent
connections would lock every client out, ``/health`` included.  Three
things prevent it:

* the process raises its soft open-file limit to the hard one at start
  (:func:`raise_open_file_limit`, ``afm serve``);
* at most ``max_connections`` are kept (:class:`ConnectionTable`, capped
  below the open-file limit by :func:`connection_cap`); at the cap a new
  connection closes the one that has been idle longest (no request in
  progress: between requests, or still sending its headers), so a new
  client, a health check among them, always gets in while idle sockets are
  what fills the table;
* when every kept connection has a request in progress, up to
  :data:`OVERFLOW` more are still served (room for ``/health`` and a cancel),
  and past those a new connection is closed at once.

An idle connection is also closed after ``ServerConfig.idle_timeout``
seconds (hypercorn's keep-alive timer, which runs from the connection's
start until its first request is complete, and between requests).

The table is plain bookkeeping (no I/O): the connection handler in
:mod:`afm_http._server` asks it on accept and tells it when the connection
turns busy, idle or closed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Generic, Literal, TypeVar

__all__ = ["OVERFLOW", "RESERVED_FILES", "ConnectionTable", "connection_cap", "raise_open_file_limit"]

log = logging.getLogger("afm.http")

OVERFLOW = 32
"""Connections served beyond the cap while every kept one is busy."""

RESERVED_FILES = 128
"""Descriptors left for everything but connections (model files, the cache
directory, threads' pipes, the listening sockets) when capping by the limit."""

Admission = Literal["serve", "overflow", "refuse"]
C = TypeVar("C")


class ConnectionTable(Generic[C]):
    """The open connections of one server (see the module docstring)."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError("the connection cap must be >= 1")
        self.cap = cap
        self._open: set[C] = set()
        self._idle: OrderedDict[C, None] = OrderedDict()  # longest idle first
        self.evicted = 0
        """Idle connections closed to make room."""
        self.refused = 0
        """Connections closed on accept: the table was full and none was idle."""

    def __len__(self) -> int:
        return len(self._open)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def admit(self, conn: C) -> tuple[Admission, C | None]:
        """Take ``conn`` in (idle, as it has no request yet) or not, and which
        idle connection to close to make room for it (None: no need)."""
        victim = None
        if len(self._open) >= self.cap:
            if self._idle:
                victim, _ = self._idle.popitem(last=False)
                self._open.discard(victim)
                self.evicted += 1
            elif len(self._open) >= self.cap + OVERFLOW:
                self.refused += 1
                return "refuse", None
        admission: Admission = "serve" if len(self._open) < self.cap else "overflow"
        self._open.add(conn)
        self._idle[conn] = None
        return admission, victim

    def mark(self, conn: C, idle: bool) -> None:
        """``conn`` has no request in progress (``idle``), or has one."""
        if conn not in self._open:
            return
        if idle:
            self._idle.pop(conn, None)
            self._idle[conn] = None  # to the end: idle since now
        else:
            self._idle.pop(conn, None)

    def release(self, conn: C) -> None:
        """``conn`` closed."""
        self._open.discard(conn)
        self._idle.pop(conn, None)


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit as far as the hard one allows
    (macOS refuses more than ``OPEN_MAX``, 10240, whatever the hard limit);
    the soft limit now (-1 where there is none to read)."""
    try:
        import resource
    except ImportError:  # (not on a POSIX system)
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    targets = [hard] if hard != resource.RLIM_INFINITY else []
    targets += [t for t in (1 << 20, 65536, 10240) if t > soft and (hard == resource.RLIM_INFINITY or t < hard)]
    for target in targets:
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        log.info("open-file limit raised from %d to %d", soft, target)
        return int(target)
    return int(soft)


def connection_cap(wanted: int) -> int:
    """``wanted``, lowered so that the cap, its overflow and
    :data:`RESERVED_FILES` fit within the soft open-file limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except ImportError:
        return wanted
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = int(soft) - RESERVED_FILES - OVERFLOW
    if room < wanted:
        log.warning("the open-file limit (%d) leaves room for %d connections, not %d", soft,
                    max(room, 1), wanted)
    return max(1, min(wanted, room))
