"""Generation threads that park between engines instead of ending.

MLX keeps per-thread state (its compiled-function cache) whose C++
destructor runs when the thread ends and needs the GIL to release what the
Python bindings put in it.  ``Thread.join`` returns before a thread's C++
destructors run; if the interpreter starts shutting down in between (a
program that exits right after closing its engine), the destructor cannot
take the GIL and the process aborts ("terminate called without an active
exception").  So the engine's generation work runs on daemon threads from a
small pool: between engines they wait for the next one, and at exit they stop
with the process without running any destructor.  There are never more pooled
threads than engines that were open at the same time.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

__all__ = ["Run", "run_on_generation_thread"]

log = logging.getLogger("afm.engine")

THREAD_NAME = "afm-generation"

_idle: list[_Parked] = []
_lock = threading.Lock()


class Run:
    """One function's run on a generation thread."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn
        self._done = threading.Event()

    def join(self) -> None:
        """Wait until the function returned."""
        self._done.wait()


class _Parked:
    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[Run] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._main, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        while True:
            run = self.inbox.get()
            try:
                run.fn()
            except BaseException:
                log.exception("generation thread function failed")
            finally:
                run.fn = _nothing  # drop what the function holds (the model, the engine)
                with _lock:
                    _idle.append(self)
                run._done.set()


def _nothing() -> None:
    pass


def run_on_generation_thread(fn: Callable[[], None]) -> Run:
    """Start ``fn`` on an idle generation thread (a new one if none is idle)."""
    with _lock:
        parked = _idle.pop() if _idle else None
    if parked is None:
        parked = _Parked()
    run = Run(fn)
    parked.inbox.put(run)
    return run
