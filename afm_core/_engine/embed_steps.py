"""Embedding work on the generation thread, a slice at a time between decode steps.

An :class:`~.commands.Embed` used to run whole when the thread drained its
commands: 16 inputs of 4 KB (36k tokens) held the decode batch so that a
running stream got 134 tokens in 14.5 s (gaps up to 1.74 s), and one 8 MB
request paused it for minutes.  :class:`EmbeddingSteps` keeps the calls
instead and, after each decode step, computes at most ``budget`` tokens
(``EngineConfig.embedding_step``) of one of them
(:class:`afm_core._mlx.embeddings.EmbeddingRun`), taking the calls in turn,
so a running stream waits at most one slice between two tokens, and a large
call does not hold up a small one.  A call whose caller left is dropped
before its next slice; its answer (the vectors, or the exception that
stopped them) goes to its ``done`` callback.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .commands import Embed

__all__ = ["EmbeddingSteps"]


class EmbeddingSteps:
    """The embedding calls one generation thread has in progress."""

    def __init__(self, model: Any, mx: Any, stream: Any, budget: int) -> None:
        if budget < 1:
            raise ValueError("the embedding step budget must be >= 1 token")
        self.model, self.mx, self.stream, self.budget = model, mx, stream, budget
        self._calls: deque[tuple[Embed, Any]] = deque()  # (command, its EmbeddingRun once started)

    def __bool__(self) -> bool:
        return bool(self._calls)

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, cmd: Embed) -> None:
        self._calls.append((cmd, None))

    def step(self) -> None:
        """One slice of the next call (then the call goes to the back of the line)."""
        from .._mlx.embeddings import EmbeddingRun

        while self._calls and self._calls[0][0].abandoned.is_set():
            self._calls.popleft()  # its caller left: nobody waits for the rest
        if not self._calls:
            return
        cmd, run = self._calls.popleft()
        try:
            with self.mx.stream(self.stream):
                if run is None:
                    run = EmbeddingRun(self.model, cmd.token_lists, cmd.pooling)
                finished = run.step(self.budget)
        except Exception as exc:  # noqa: BLE001 - the caller's error, not the thread's
            cmd.done(exc)
            return
        if finished:
            cmd.done(run.result())
        else:
            self._calls.append((cmd, run))
