# cython: language_level=3
"""Per-stream token pipeline (Cython twin of ``afm_core._stream.pipeline_py``).

Same wiring, same event order: detokenizer -> stop strings -> reasoning ->
tool-call tracker -> structured output.  The stages are the (compiled)
stream-core objects; this twin removes the Python-level glue per token.
"""

from afm_core._stream.events import ContentDelta as _ContentDelta
from afm_core._stream.events import ReasoningDelta as _ReasoningDelta
from afm_core._stream.stops import StopMatcher

__all__ = ["StreamPipeline"]

cdef object ContentDelta = _ContentDelta
cdef object ReasoningDelta = _ReasoningDelta


cdef class StreamPipeline:
    cdef object _detok, _detok_feed, _stops, _reasoning, _tools, _structured
    cdef public Py_ssize_t text_chars

    def __init__(self, detokenizer, *, stops=(), reasoning=None, tools=None, structured=None):
        self._detok = detokenizer
        self._detok_feed = detokenizer.feed
        self._stops = StopMatcher(stops) if stops else None
        self._reasoning = reasoning
        self._tools = tools
        self._structured = structured
        self.text_chars = 0

    @property
    def saw_tool_call(self):
        return bool(self._tools is not None and getattr(self._tools, "saw_tool_call", False))

    def feed_token(self, token_id, list out):
        cdef str text = self._detok_feed(token_id)
        cdef bint stopped = False
        if not text:
            return False
        if self._stops is not None:
            text, stopped = self._stops.feed(text)
        if text:
            self._route(text, out)
        return stopped

    def finish(self, list out):
        cdef str text = self._detok.flush()
        if self._stops is not None:
            if text:
                text, _ = self._stops.feed(text)
            text += self._stops.flush()
        if text:
            self._route(text, out)
        if self._reasoning is not None:
            self._content(self._reasoning.flush(), out)
        if self._tools is not None:
            self._structure(self._tools.flush(), out)
        if self._structured is not None:
            out.extend(self._structured.flush())

    cdef _route(self, str text, list out):
        self.text_chars += len(text)
        if self._reasoning is None:
            self._content([ContentDelta(text)], out)
        else:
            self._content(self._reasoning.feed(text), out)

    cdef _content(self, list events, list out):
        cdef object tools = self._tools
        for ev in events:
            if type(ev) is ReasoningDelta:
                out.append(ev)
            elif tools is not None:
                self._structure(tools.feed(ev.text), out)
            else:
                self._structure([ev], out)

    cdef _structure(self, list events, list out):
        cdef object st = self._structured
        if st is None:
            out.extend(events)
            return
        for ev in events:
            if type(ev) is ContentDelta:
                out.extend(st.feed(ev.text))
            else:
                out.append(ev)
