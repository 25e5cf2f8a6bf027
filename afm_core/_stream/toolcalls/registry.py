"""Tool-call formats by name, and a guess of a model's format from its template.

The engine builds one tracker per request::

    tracker = make_tool_tracker(fmt, tools=request.tools,
                                parallel_tool_calls=request.parallel_tool_calls)
    events = tracker.feed(text)     # per content delta
    events += tracker.flush()       # at the end of the stream
    finish = "tool_calls" if tracker.saw_tool_call else reason

Rules shared by every format (each format module documents its own):

* with a ``tools`` list only its names are accepted; a call naming another
  tool is returned verbatim as content (vLLM-like; never a silent drop of
  user-visible text); ``tools=None`` accepts any name;
* ``parallel_tool_calls=False``: the first accepted call is the turn's only
  call; later calls are parsed and dropped (counted in ``tracker.dropped``),
  not turned into content, since they are tool-call markup;
* malformed calls before any fragment went out are content verbatim;
  after fragments went out the call is closed and an entry is added to
  ``tracker.errors`` (a ``ToolCallFailure``); nothing is ever raised for model
  output.  An unclosed call at ``flush()`` keeps its streamed fragments and
  gets an error (Qwen3-Coder's generated JSON is closed first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from .base import ToolFormat, new_call_id, tool_names
from .hermes import HermesFormat
from .llama3 import Llama3JSONFormat
from .mistral import MistralFormat
from .qwen3_coder import Qwen3CoderFormat

__all__ = ["FORMATS", "guess_tool_format", "make_tool_format", "make_tool_tracker"]

FORMATS = ("hermes", "qwen3_coder", "llama3_json", "mistral")
_ALIASES = {
    "qwen": "hermes",
    "qwen3": "hermes",
    "json_tools": "hermes",
    "qwen3coder": "qwen3_coder",
    "llama3": "llama3_json",
    "llama": "llama3_json",
}


def make_tool_format(fmt: str, tools: Any = None) -> ToolFormat:
    """A fresh format state machine for ``fmt`` (a name in ``FORMATS`` or an alias)."""
    name = _ALIASES.get(fmt, fmt)
    if name == "hermes":
        return HermesFormat()
    if name == "qwen3_coder":
        return Qwen3CoderFormat(tools)
    if name == "llama3_json":
        return Llama3JSONFormat()
    if name == "mistral":
        return MistralFormat()
    raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")


def make_tool_tracker(
    fmt: str,
    *,
    tools: Any = None,
    parallel_tool_calls: bool = True,
    id_factory: Callable[[], str] = new_call_id,
    impl: ModuleType | None = None,
) -> Any:
    """A ``ToolCallTracker`` for one stream; ``impl`` picks a twin module (tests)."""
    if impl is None:
        from .. import tools as _tools

        impl = _tools
    return impl.ToolCallTracker(
        make_tool_format(fmt, tools),
        names=tool_names(tools),
        parallel_tool_calls=parallel_tool_calls,
        id_factory=id_factory,
    )


def guess_tool_format(chat_template: str | None, vocab: Iterable[str] | None = None) -> str | None:
    """The wire format a model was trained on, from its chat template and vocabulary."""
    template = chat_template or ""
    words = set(vocab) if vocab is not None else set()

    def has(tag: str) -> bool:
        return tag in template or tag in words

    if "<function=" in template and ("<tool_call>" in template or "<parameter=" in template):
        return "qwen3_coder"
    if has("<tool_call>"):
        return "hermes"
    if has("[TOOL_CALLS]"):
        return "mistral"
    if has("<|python_tag|>") or "ipython" in template:
        return "llama3_json"
    return None
