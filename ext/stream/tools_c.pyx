# cython: language_level=3
"""Tool-call fragment tracker (Cython twin of ``afm_core._stream.tools_py``).

Same modes, same events, same errors; the JSON scanner reads the string's
code points directly and events are built without the frozen dataclass
``__init__`` (allocate, then set each slot through its member descriptor).
"""

import json as _json
from json.encoder import encode_basestring as _encode_basestring

from afm_core._stream.events import ContentDelta as _ContentDelta
from afm_core._stream.events import ToolCallDelta as _ToolCallDelta
from afm_core._stream.toolcalls.base import CAPTURE as _CAPTURE
from afm_core._stream.toolcalls.base import DROP as _DROP
from afm_core._stream.toolcalls.base import DROPPED as _DROPPED
from afm_core._stream.toolcalls.base import EMIT as _EMIT
from afm_core._stream.toolcalls.base import UNKNOWN as _UNKNOWN
from afm_core._stream.toolcalls.base import ToolCallFailure as _ToolCallFailure
from afm_core._stream.toolcalls.base import new_call_id as _new_call_id

__all__ = ["ToolCallTracker"]

cdef extern from "Python.h":
    unsigned int PyUnicode_KIND(object o)
    void* PyUnicode_DATA(object o)
    Py_UCS4 PyUnicode_READ(unsigned int kind, void* data, Py_ssize_t index)

cdef extern from *:
    """
    static PyObject* afm_alloc(PyObject* cls) {
        PyTypeObject* t = (PyTypeObject*)cls;
        return t->tp_alloc(t, 0);
    }
    static int afm_set(PyObject* descr, PyObject* obj, PyObject* value) {
        return Py_TYPE(descr)->tp_descr_set(descr, obj, value);
    }
    """
    object afm_alloc(object cls)
    int afm_set(object descr, object obj, object value) except -1

cdef object ContentDelta = _ContentDelta
cdef object ToolCallDelta = _ToolCallDelta
cdef object ToolCallFailure = _ToolCallFailure
cdef object CONTENT_TEXT = _ContentDelta.__dict__["text"]
cdef object TC_INDEX = _ToolCallDelta.__dict__["index"]
cdef object TC_ARGS = _ToolCallDelta.__dict__["arguments"]
cdef object TC_ID = _ToolCallDelta.__dict__["id"]
cdef object TC_NAME = _ToolCallDelta.__dict__["name"]
cdef object encode_basestring = _encode_basestring
cdef object json_loads = _json.loads

cdef enum:
    PASS = 0
    TEXT = 1
    COLD = 2
    JSON = 3
    UNTIL = 4
    STRING = 5

cdef enum:
    EMIT = 0
    CAPTURE = 1
    DROP = 2

assert (_EMIT, _CAPTURE, _DROP) == (EMIT, CAPTURE, DROP)

cdef int UNKNOWN = _UNKNOWN
cdef int DROPPED = _DROPPED


cdef inline object content_delta(str text):
    cdef object ev = afm_alloc(ContentDelta)
    afm_set(CONTENT_TEXT, ev, text)
    return ev


cdef inline object tool_delta(object index, str piece, object call_id, object name):
    cdef object ev = afm_alloc(ToolCallDelta)
    afm_set(TC_INDEX, ev, index)
    afm_set(TC_ARGS, ev, piece)
    afm_set(TC_ID, ev, call_id)
    afm_set(TC_NAME, ev, name)
    return ev


include "_text.pxi"


cdef inline str _escape(str text):
    """``text`` as the body of a JSON string."""
    cdef str quoted = encode_basestring(text)
    return quoted[1:len(quoted) - 1]


cdef inline bint _literal(Py_UCS4 c):
    return (
        (c >= 48 and c <= 57)  # 0-9
        or (c >= 97 and c <= 122)  # a-z
        or (c >= 65 and c <= 90)  # A-Z
        or c == 45 or c == 43 or c == 46  # - + .
    )


cdef class ToolCallTracker:
    """One stream's tool calls in one wire format; ``feed`` text, ``flush`` at the end."""

    cdef readonly object format
    cdef object _names
    cdef bint _parallel
    cdef object _new_id
    cdef list _out
    cdef str _buf
    cdef str _gap
    cdef int _mode
    cdef str _tag
    cdef int _sink
    cdef str _close
    cdef bint _strip_nl
    cdef Py_ssize_t _depth
    cdef bint _in_str
    cdef bint _esc
    cdef bint _prim
    cdef list _captured
    cdef list _pieces
    cdef Py_ssize_t _index
    cdef readonly bint scan_failed
    cdef readonly Py_ssize_t calls
    cdef readonly Py_ssize_t dropped
    cdef readonly list errors

    def __init__(self, fmt, *, names=None, parallel_tool_calls=True, id_factory=_new_call_id):
        self.format = fmt
        self._names = names
        self._parallel = bool(parallel_tool_calls)
        self._new_id = id_factory
        self._out = []
        self._buf = ""
        self._gap = ""
        self._mode = COLD
        self._tag = ""
        self._sink = EMIT
        self._close = ""
        self._strip_nl = False
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._prim = False
        self._captured = []
        self._pieces = []
        self._index = -1
        self.scan_failed = False
        self.calls = 0
        self.dropped = 0
        self.errors = []
        fmt.start(self)

    @property
    def saw_tool_call(self):
        """Whether any call was accepted (finish_reason ``tool_calls``)."""
        return self.calls > 0

    # -- stream ---------------------------------------------------------------
    cpdef list feed(self, str text):
        """Events for one text delta."""
        cdef list out = []
        cdef int mode
        cdef Py_ssize_t used
        self._out = out
        if self._buf:
            text = self._buf + text
            self._buf = ""
        while text:
            mode = self._mode
            if mode == JSON:
                text = self._scan_json(text)
            elif mode == TEXT:
                text = self._scan_text(text)
            elif mode == STRING:
                text = self._scan_string(text)
            elif mode == UNTIL:
                text = self._scan_until(text)
            elif mode == PASS:
                out.append(content_delta(text))
                break
            else:
                used = self.format.step(self, text)
                if used < 0:
                    self._buf = text
                    break
                if used:
                    text = text[used:]
                continue
            if not text and self._mode == COLD:
                self.format.step(self, "")
        return out

    cpdef list flush(self):
        """End of stream: release held text; the format settles an unclosed call."""
        cdef list out = []
        cdef str text = self._buf
        cdef int mode = self._mode
        cdef str pending
        self._out = out
        self._buf = ""
        self._mode = COLD
        if mode == PASS or mode == TEXT:
            self.content(text)
            self._gap = ""  # the layout after the last call
            return out
        pending = text
        if mode == STRING:
            if text:
                self.args(_escape(text))
            self.args(self._close)
            pending = ""
        elif mode == JSON or mode == UNTIL:
            pending = "".join(self._captured) + text if self._sink == CAPTURE else ""
            self._captured = []
        self.format.finish(self, pending)
        if self._index >= 0:
            self.close_call()
        return out

    # -- the format's interface ----------------------------------------------
    cpdef content(self, str text):
        """Content outside calls; once a call was accepted, trailing whitespace
        is held until other text follows (see ``TEXT`` mode)."""
        cdef str body
        if not text:
            return
        if self.calls:
            body = text.rstrip()
            if not body:
                self._gap += text
                return
            text, self._gap = self._gap + body, text[len(body):]
        self._out.append(content_delta(text))

    cpdef int open_call(self, str name) except? -100:
        """Start a call: its index, or UNKNOWN / DROPPED (then nothing is emitted)."""
        cdef Py_ssize_t index
        if self._names is not None and name not in self._names:
            return UNKNOWN
        if not self._parallel and self.calls:
            self.dropped += 1
            return DROPPED
        if self._index >= 0:
            self.close_call()
        index = self.calls
        self.calls += 1
        self._index = index
        self._pieces = []
        self._out.append(tool_delta(index, "", self._new_id(), name))
        return index

    cpdef args(self, str piece):
        """An argument fragment of the open call (ignored when none is open)."""
        if piece and self._index >= 0:
            self._pieces.append(piece)
            self._out.append(tool_delta(self._index, piece, None, None))

    cpdef close_call(self):
        """Close the open call, recording an error if its arguments are not a JSON object."""
        cdef Py_ssize_t index = self._index
        cdef str text
        if index < 0:
            return
        self._index = -1
        text = "".join(self._pieces)
        self._pieces = []
        try:
            value = json_loads(text)
        except ValueError as exc:
            self.errors.append(ToolCallFailure(index, f"arguments are not valid JSON: {exc}"))
            return
        if not isinstance(value, dict):
            self.errors.append(ToolCallFailure(index, "arguments are not a JSON object"))

    cpdef fail(self, str message):
        """Close the open call as malformed (its fragments stay as streamed)."""
        if self._index >= 0:
            self.errors.append(ToolCallFailure(self._index, message))
            self._index = -1
            self._pieces = []

    def pass_mode(self):
        self._mode = PASS

    def text_mode(self, str tag):
        self._mode = TEXT
        self._tag = tag

    def json_mode(self, int sink, Py_ssize_t depth=0):
        self._mode = JSON
        self._sink = sink
        self._depth = depth
        self._in_str = self._esc = self._prim = False
        self.scan_failed = False

    def until_mode(self, str tag, int sink):
        self._mode = UNTIL
        self._tag = tag
        self._sink = sink

    def string_mode(self, str terminator, str close, bint strip_newline):
        self._mode = STRING
        self._tag = terminator
        self._close = close
        self._strip_nl = strip_newline

    def take_captured(self):
        cdef str text = "".join(self._captured)
        self._captured = []
        return text

    # -- hot loops --------------------------------------------------------------
    cdef inline void _sink_text(self, str piece):
        if not piece:
            return
        if self._sink == EMIT:
            self.args(piece)
        elif self._sink == CAPTURE:
            self._captured.append(piece)

    cdef str _scan_text(self, str text):
        cdef str tag = self._tag
        cdef Py_ssize_t i = text.find(tag)
        cdef Py_ssize_t keep, n
        if i >= 0:
            if i:
                self.content(text[:i])
            self._gap = ""
            self._mode = COLD
            return text[i:]
        keep = _partial(text, tag)
        if keep:
            n = len(text)
            self._buf = text[n - keep:]
            text = text[:n - keep]
        if text:
            self.content(text)
        return ""

    cdef str _scan_until(self, str text):
        cdef str tag = self._tag
        cdef Py_ssize_t i = text.find(tag)
        cdef Py_ssize_t keep, n
        if i >= 0:
            self._sink_text(text[:i])
            self._mode = COLD
            return text[i + len(tag):]
        keep = _partial(text, tag)
        if keep:
            n = len(text)
            self._buf = text[n - keep:]
            text = text[:n - keep]
        self._sink_text(text)
        return ""

    cdef str _scan_string(self, str text):
        cdef str tag = self._tag
        cdef Py_ssize_t i = text.find(tag)
        cdef Py_ssize_t n, cut
        cdef str value
        if i >= 0:
            value = text[:i]
            if self._strip_nl and value.endswith("\n"):
                value = value[:len(value) - 1]
            self.args(_escape(value) + self._close)
            self._mode = COLD
            return text[i + len(tag):]
        n = len(text)
        cut = n - _partial(text, tag)
        if self._strip_nl and cut > 0 and text[cut - 1] == "\n":
            cut -= 1
        if cut < n:
            self._buf = text[cut:]
        if cut:
            self.args(_escape(text[:cut]))
        return ""

    cdef str _scan_json(self, str text):
        cdef Py_ssize_t depth = self._depth
        cdef bint in_str = self._in_str
        cdef bint esc = self._esc
        cdef bint prim = self._prim
        cdef Py_ssize_t n = len(text)
        cdef Py_ssize_t end = -1
        cdef Py_ssize_t i = 0
        cdef bint bad = False
        cdef unsigned int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        cdef Py_UCS4 c
        while i < n:
            c = PyUnicode_READ(kind, data, i)
            if in_str:
                if esc:
                    esc = False
                elif c == 92:  # backslash
                    esc = True
                elif c == 34:  # quote
                    in_str = False
                    if depth == 0:
                        end = i + 1
                        break
            elif c == 34:
                if prim:
                    bad = True
                    break
                in_str = True
            elif c == 123 or c == 91:  # { [
                if prim:
                    bad = True
                    break
                depth += 1
            elif c == 125 or c == 93:  # } ]
                if depth == 0:
                    bad = not prim
                    end = i
                    break
                depth -= 1
                if depth == 0:
                    end = i + 1
                    break
            elif c == 44:  # ,
                if depth == 0:
                    bad = not prim
                    end = i
                    break
            elif c == 32 or c == 9 or c == 13 or c == 10:
                if depth == 0 and prim:
                    end = i
                    break
            elif c == 58:  # :
                if depth == 0:
                    bad = True
                    break
            elif _literal(c):
                if depth == 0:
                    prim = True
            else:
                bad = True
                break
            i += 1
        if bad:
            end = i
            self.scan_failed = True
        self._depth = depth
        self._in_str = in_str
        self._esc = esc
        self._prim = prim
        if end < 0:
            self._sink_text(text)
            return ""
        self._sink_text(text[:end])
        self._mode = COLD
        return text[end:]
