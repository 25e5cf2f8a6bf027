# cython: language_level=3
"""Reasoning splitter (Cython twin of ``afm_core._stream.reasoning_py``).

Events are built without the frozen dataclass ``__init__``: allocate, then
set the slot through its member descriptor, which is what ``__init__``'s
``object.__setattr__`` does, at a tenth of the cost.
"""

from afm_core._stream.events import ContentDelta as _ContentDelta
from afm_core._stream.events import ReasoningDelta as _ReasoningDelta

__all__ = ["ReasoningSplitter"]

cdef extern from *:
    """
    static PyObject* afm_event1(PyObject* cls, PyObject* descr, PyObject* value) {
        PyTypeObject* t = (PyTypeObject*)cls;
        PyObject* obj = t->tp_alloc(t, 0);
        if (obj == NULL) return NULL;
        if (Py_TYPE(descr)->tp_descr_set(descr, obj, value) < 0) {
            Py_DECREF(obj);
            return NULL;
        }
        return obj;
    }
    """
    object afm_event1(object cls, object descr, object value)

cdef object ContentDelta = _ContentDelta
cdef object ReasoningDelta = _ReasoningDelta
cdef object CONTENT_TEXT = _ContentDelta.__dict__["text"]
cdef object REASONING_TEXT = _ReasoningDelta.__dict__["text"]

cdef enum:
    PASS = 0
    BEFORE = 1
    FRESH = 2
    INSIDE = 3


cdef inline object content(str text):
    return afm_event1(ContentDelta, CONTENT_TEXT, text)


cdef inline object reasoning(str text):
    return afm_event1(ReasoningDelta, REASONING_TEXT, text)


include "_text.pxi"


cdef class ReasoningSplitter:
    """Split one stream's text into reasoning and content."""

    cdef readonly str start
    cdef readonly str end
    cdef str _held
    cdef int _state

    def __init__(self, str start="<think>", str end="</think>", *, started=False, enabled=True):
        if not start or not end:
            raise ValueError("reasoning tags must be non-empty")
        self.start = start
        self.end = end
        self._held = ""
        if not enabled:
            self._state = PASS
        elif started:
            self._state = FRESH
        else:
            self._state = BEFORE

    @property
    def in_reasoning(self):
        """Whether the next text would be reasoning."""
        return self._state == FRESH or self._state == INSIDE

    cpdef list feed(self, str text):
        """Events for one text delta (possibly none while a tag prefix is held)."""
        cdef int state = self._state
        cdef list out
        cdef str tag
        cdef Py_ssize_t i, keep, n
        if state == PASS:
            return [content(text)] if text else []
        if self._held:
            text = self._held + text
            self._held = ""
        out = []
        while text:
            if state == FRESH:
                if len(text) < len(self.start) and self.start.startswith(text):
                    self._held = text
                    break
                if text.startswith(self.start):
                    text = text[len(self.start):]
                state = INSIDE
                continue
            tag = self.end if state == INSIDE else self.start
            i = text.find(tag)
            if i < 0:
                keep = _partial(text, tag)
                if keep:
                    n = len(text)
                    self._held = text[n - keep:]
                    text = text[:n - keep]
                if text:
                    out.append(reasoning(text) if state == INSIDE else content(text))
                break
            if i:
                out.append(reasoning(text[:i]) if state == INSIDE else content(text[:i]))
            text = text[i + len(tag):]
            if state == INSIDE:
                state = PASS
                if text:
                    out.append(content(text))
                break
            state = INSIDE
        self._state = state
        return out

    cpdef list flush(self):
        """End of stream: release a held tag prefix in the current channel."""
        cdef str held = self._held
        self._held = ""
        if not held:
            return []
        if self._state == FRESH or self._state == INSIDE:
            return [reasoning(held)]
        return [content(held)]
