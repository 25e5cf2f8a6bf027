"""Types of the Cython build ``pipeline_c`` (from ``ext/stream/pipeline_c.pyx``); twin of ``pipeline_py``."""

from typing import Any

from .events import Event
from .pipeline_py import TextStage

__all__ = ["StreamPipeline"]

class StreamPipeline:
    text_chars: int
    def __init__(
        self,
        detokenizer: Any,
        *,
        stops: tuple[str, ...] = (),
        reasoning: TextStage | None = None,
        tools: TextStage | None = None,
        structured: TextStage | None = None,
    ) -> None: ...
    @property
    def saw_tool_call(self) -> bool: ...
    def feed_token(self, token_id: int, out: list[Event]) -> bool: ...
    def finish(self, out: list[Event]) -> None: ...
