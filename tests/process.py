"""A child process whose stderr lines a test waits on (``afm serve``, a rank)."""

from __future__ import annotations

import queue
import re
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence


class LoggedProcess:
    """``argv`` started with its stderr read, line by line, by a thread."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(list(argv), env=None if env is None else dict(env),
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put("")

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match[str] | None:
        """The first new line matching ``pattern``; None when the process ended
        first (``queue.Empty`` when ``timeout`` seconds pass)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            self.seen.append(line)
            if not line:
                return None
            if m := re.search(pattern, line):
                return m

    def log(self) -> str:
        """Every line so far."""
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return "".join(self.seen)
            self.seen.append(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
