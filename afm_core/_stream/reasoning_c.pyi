"""Types of the Cython build ``reasoning_c`` (from ``ext/stream/reasoning_c.pyx``); twin of ``reasoning_py``."""

from .events import ContentDelta, ReasoningDelta

__all__ = ["ReasoningSplitter"]

class ReasoningSplitter:
    def __init__(
        self,
        start: str = "<think>",
        end: str = "</think>",
        *,
        started: bool = False,
        enabled: bool = True,
    ) -> None: ...
    @property
    def start(self) -> str: ...
    @property
    def end(self) -> str: ...
    @property
    def in_reasoning(self) -> bool: ...
    def feed(self, text: str) -> list[ContentDelta | ReasoningDelta]: ...
    def flush(self) -> list[ContentDelta | ReasoningDelta]: ...
