"""What a caller reads from the engine: a request's events (:class:`ChatStream`)
and an :meth:`Engine.embed <.engine.Engine.embed>` call's vectors (:class:`Embeddings`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from .._stream.events import Event, Finish, StreamFailure
from ..api.chat import Writer as ChatWriter
from .commands import PromptLogprobs, RequestId, RequestRecord
from .mailbox import Mailbox

TERMINAL = (Finish, StreamFailure)
"""The events that end a stream (``Usage`` and ``Profile`` ride in the same batch)."""


@dataclass(frozen=True, slots=True)
class Embeddings:
    """What :meth:`Engine.embed` returns: one L2-normalized vector per input
    (in the inputs' order) and each input's token count."""

    vectors: list[list[float]]
    token_counts: tuple[int, ...]
    pooling: str
    """The pooling used: ``mean``, ``last`` or ``cls``."""

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every input together (the usage's ``prompt_tokens``)."""
        return sum(self.token_counts)


class ChatStream:
    """One request's events; iterate it, or ``batches()`` for one tuple per step."""

    def __init__(self, *, id: str, created: int, model: str, request_id: RequestId,
                 mailbox: Mailbox, prompt_tokens: int, grammar_downgraded: bool,
                 record: RequestRecord | None = None):
        self.id = id
        self.created = created
        self.model = model
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.grammar_downgraded = grammar_downgraded
        self._mailbox = mailbox
        self._record = record
        self._ended = False

    @property
    def finished(self) -> bool:
        """True once every event of the stream has arrived: reading will not wait."""
        return self._mailbox.closed

    @property
    def prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt's own tokens scored (a :class:`CompletionRequest` with
        ``prompt_logprobs``), set before the batch that carries the first
        token (or the finish) is read; None until then, and for other requests."""
        return self._record.prompt_logprobs if self._record is not None else None

    async def next_batch(self) -> tuple[Event, ...] | None:
        """The next batch :meth:`batches` would yield, or None at the end.
        Safe to cancel: a cancelled call takes nothing from the stream."""
        if self._ended:
            return None
        batch = await self._mailbox.take()
        # Usage/Profile ride in the same batch as Finish
        if batch is None or any(isinstance(e, TERMINAL) for e in batch):
            self._ended = True
        return batch

    async def batches(self) -> AsyncIterator[tuple[Event, ...]]:
        """Everything that arrived since the last batch (one engine step, or
        several when the reader fell behind), until the stream ends."""
        while (batch := await self.next_batch()) is not None:
            yield batch

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for batch in self.batches():
            for event in batch:
                yield event

    async def collect(self) -> dict[str, Any]:
        """The whole stream as a ``chat.completion`` dict (the non-streaming shape),
        folded by the chat translation's writer (:mod:`afm_core.api.chat`); raises
        :class:`GenerationError` if the stream failed or ended without a finish."""
        writer = ChatWriter(id=self.id, created=self.created, model=self.model, stream=False)
        while not writer.ended(0):
            batch = await self.next_batch()
            if batch is None:
                writer.close(0)
                break
            writer.feed(0, batch)
        return writer.result()
