"""Stream events: what the engine emits and the SSE encoder writes.

Frozen, slotted dataclasses; every layer speaks them.  A stream is a sequence
of deltas (content, reasoning, tool-call fragments, logprobs) followed by one
``Finish``, an optional ``Usage``, an optional ``Profile``, or a
``StreamFailure`` in place of the finish when generation failed.  A stream
that asks for them (``Engine.stream(..., progress=True)``) also carries
``PromptProgress`` events while its prompt is prefilled, before its first delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """A piece of the assistant's ``content``."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """A piece of ``reasoning_content`` (extracted thinking)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of tool call ``index``.

    The first fragment of a call carries ``id`` (``call_…``) and ``name``;
    later fragments carry only ``arguments`` pieces.  Concatenating every
    fragment's ``arguments`` gives the call's final JSON argument string.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...] | None


MIN_LOGPROB = -9999.0
"""The lowest log-probability any wire API writes (strict JSON has no ``-inf``)."""


def clamp_logprob(value: float) -> float:
    """``value`` as every wire API writes it: within ``[MIN_LOGPROB, 0.0]``
    (``-inf`` and NaN become ``MIN_LOGPROB``)."""
    if value >= MIN_LOGPROB:  # False for NaN too
        return value if value <= 0.0 else 0.0
    return MIN_LOGPROB


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """OpenAI ``logprobs.content[]`` entry for one sampled token."""

    token: str
    logprob: float
    bytes: tuple[int, ...] | None
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class LogprobsDelta:
    """Logprobs of the tokens generated since the previous delta."""

    content: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class Finish:
    """End of the choice: ``stop``, ``length``, ``tool_calls`` or ``cancelled``."""

    reason: str


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    """Prompt tokens newly written to the prefix cache up to the request's last
    cache breakpoint (Anthropic's ``cache_creation_input_tokens``; 0 without one)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class Profile:
    """AFM profile: ``{"afm_profile": payload}`` or ``{"afm_profile_extended": payload}``."""

    payload: dict[str, Any] = field(default_factory=dict)
    extended: bool = False

    @property
    def key(self) -> str:
        return "afm_profile_extended" if self.extended else "afm_profile"


@dataclass(frozen=True, slots=True)
class StreamFailure:
    """A generation error after the stream began (an error-marked chunk).

    An event, not an exception.  ``StreamError`` (also ``afm_core.StreamError``)
    is its former name, kept as an alias of this class.
    """

    message: str
    type: str = "server_error"
    code: str | None = None
    param: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """How far the prompt's prefill has come (llama.cpp's ``prompt_progress``).

    Sent only to a stream opened with ``progress=True``: one when the
    generation thread starts the prompt (``processed == cached``), one per
    prefill chunk, and a last one with ``processed == total`` before the
    first token.  Counts are over the whole prompt; cached tokens count as
    processed.
    """

    processed: int
    """Prompt tokens in the request's KV cache so far, the cached ones included."""
    total: int
    """Prompt tokens."""
    cached: int
    """Prompt tokens not computed for this request: a prefix-cache hit, or
    another request's prefill of the same prompt."""
    time_ms: float = 0.0
    """Milliseconds since the generation thread took the request in."""

    def to_dict(self) -> dict[str, Any]:
        """The wire form, llama.cpp's ``prompt_progress`` object."""
        return {"total": self.total, "cache": self.cached, "processed": self.processed,
                "time_ms": round(self.time_ms, 3)}


StreamError = StreamFailure  # the former name (public as afm_core.StreamError)

Delta = ContentDelta | ReasoningDelta | ToolCallDelta | LogprobsDelta
Event = Delta | Finish | Usage | Profile | StreamFailure | PromptProgress
