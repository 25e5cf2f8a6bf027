"""The Responses writer's records: one output item while it streams, one choice's state.

Used by :class:`afm_core.api.responses.ResponseWriter`.

May import: :mod:`afm_core._stream`, the standard library.
"""

from __future__ import annotations

from typing import Any

from .._stream.events import TokenLogprob, Usage, clamp_logprob

__all__ = ["Choice", "Item", "logprob_entry"]


def logprob_entry(entry: TokenLogprob) -> dict[str, Any]:
    """One ``logprobs`` entry of an ``output_text`` part."""
    return {
        "token": entry.token,
        "bytes": list(entry.bytes) if entry.bytes is not None else [],
        "logprob": clamp_logprob(entry.logprob),
        "top_logprobs": [{"token": t.token, "bytes": list(t.bytes) if t.bytes is not None else [],
                          "logprob": clamp_logprob(t.logprob)} for t in entry.top_logprobs],
    }


class Item:
    """One output item while it streams."""

    __slots__ = ("call_id", "choice", "encrypted", "id", "index", "kind", "logprobs", "name",
                 "namespace", "parts", "status", "tagged")

    def __init__(self, kind: str, id: str, index: int, choice: int, *, tagged: bool = False,
                 call_id: str = "", name: str = "", namespace: str | None = None) -> None:
        self.kind = kind
        self.id = id
        self.index = index
        self.choice = choice
        self.tagged = tagged
        self.call_id = call_id
        self.name = name
        self.namespace = namespace
        """A call to a function of a ``namespace`` tool: the namespace (``name`` is the function's)."""
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.encrypted = ""
        """A ``compaction`` item's ``encrypted_content`` (set when it closes)."""

    @property
    def done(self) -> bool:
        return self.status != "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "summary_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [],
                "logprobs": list(self.logprobs)}

    def to_dict(self) -> dict[str, Any]:
        status = self.status
        if self.kind == "reasoning":
            summary = [self.part()] if self.parts or self.done else []
            out: dict[str, Any] = {"id": self.id, "type": "reasoning", "summary": summary,
                                   "status": status}
        elif self.kind == "compaction":
            out = {"id": self.id, "type": "compaction", "encrypted_content": self.encrypted}
        elif self.kind == "message":
            content = [self.part()] if self.parts or self.done else []
            out = {"id": self.id, "type": "message", "status": status, "role": "assistant",
                   "content": content}
        else:
            out = {"id": self.id, "type": "function_call", "status": status,
                   "arguments": self.text, "call_id": self.call_id, "name": self.name}
            if self.namespace is not None:
                out["namespace"] = self.namespace
        if self.tagged:  # n > 1: which choice the item belongs to (afm's extension)
            out["choice_index"] = self.choice
        return out


class Choice:
    """One choice's state: its items (and which are open), its finish and usage."""

    __slots__ = ("calls", "ended", "finish", "index", "items", "lp_pending", "message", "reasoning",
                 "reasoning_tokens", "usage")

    def __init__(self, index: int) -> None:
        self.index = index
        self.items: list[Item] = []
        self.reasoning: Item | None = None
        self.message: Item | None = None
        self.calls: dict[int, Item] = {}
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.lp_pending: list[dict[str, Any]] = []
        """Logprobs of tokens whose text is still held back (they join the next text delta)."""
        self.reasoning_tokens: int | None = None
        self.ended = False
