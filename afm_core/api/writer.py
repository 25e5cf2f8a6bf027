"""The one interface every wire API's writer has.

A request runs one engine stream per choice (chat's and completions' ``n``,
a completions body's prompts, Responses' ``n``; one for the other APIs).  Its
API's writer takes every batch of engine events (one engine step, or several
when the reader fell behind) of each choice, and gives back that API's bytes:
SSE frames (chat, completions, Anthropic Messages, Responses) or NDJSON lines
(Ollama).  The same calls build the final object, so a non-streamed answer is
the same state machine, not a second path::

    writer = chat.Writer(id=..., created=..., model=..., choices=n, stream=True)
    out = writer.start()                    # bytes before any event (may be b"")
    for each engine step, for each choice i that had a batch:
        out = writer.feed(i, batch)         # or writer.close(i): its stream ended
        if writer.stop_requested: engine.cancel(request_id)
        stop reading choice i once writer.ended(i); everything once writer.done
    out = writer.keepalive()                # when the engine has been silent (b"": nothing)
    out = writer.fail("...")                # a failure outside the streams (in band)
    out = writer.end()                      # the last bytes ([DONE], a terminal event)
    writer.result()                         # the non-streamed object; raises the API's error

A writer built with ``stream=False`` returns ``b""`` from every call and only
builds :meth:`~Writer.result`.  A failure before anything was sent is an
exception (:class:`~afm_core.RequestError` and kin), which the HTTP layer
answers in the API's own error envelope (each API module's ``error_body``).

``afm_http`` drives every writer with one loop (``afm_http._drive``): the
keepalive timer, failures, the client leaving, cancel.  A new wire API is a
parser (its JSON → :class:`~afm_core.ChatRequest` or
:class:`~afm_core.CompletionRequest`), a :class:`Writer`, and a route table.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .._stream.events import Event, StreamFailure

__all__ = ["INTERRUPTED", "SSE_KEEPALIVE", "Writer"]

INTERRUPTED = StreamFailure("the stream ended before it finished", code="stream_interrupted")
"""A choice whose engine stream ended without a finish (the engine shut down)."""

SSE_KEEPALIVE = b": keepalive\n\n"
"""The SSE comment the OpenAI-shaped streams send while the engine is silent
(every SSE client ignores comments)."""


class Writer(Protocol):
    """One response of one wire API, for all of its choices (see the module docstring)."""

    media_type: str
    """The streamed body's ``Content-Type``."""

    @property
    def done(self) -> bool:
        """Nothing more will be written: every choice ended, or the response failed."""
        ...

    @property
    def stop_requested(self) -> bool:
        """The writer saw the end of the answer before the engine did (Anthropic's
        ``stop_sequences``): end the engine request now; what it still sends is dropped."""
        ...

    def start(self) -> bytes:
        """What comes before the first event (Responses' ``response.created``, ...)."""
        ...

    def feed(self, choice: int, events: Sequence[Event]) -> bytes:
        """The bytes for one batch of choice ``choice``'s events."""
        ...

    def close(self, choice: int) -> bytes:
        """Choice ``choice``'s stream has no more events: what it is still owed
        (an error, when it never finished)."""
        ...

    def ended(self, choice: int) -> bool:
        """Choice ``choice`` needs no more events."""
        ...

    def keepalive(self) -> bytes:
        """What to send when the engine has been silent a while (b"": nothing)."""
        ...

    def fail(self, message: str) -> bytes:
        """End the response with a failure outside the streams (headers are sent)."""
        ...

    def end(self) -> bytes:
        """The last bytes of the body (nothing more follows)."""
        ...

    def result(self) -> dict[str, Any]:
        """The non-streamed answer; raises an :class:`~afm_core.AFMError` if the response failed."""
        ...
