# cython: language_level=3
"""SSE frame encoder (Cython twin of ``afm_core._stream.sse_py``).

Hot frames (content, reasoning, tool arguments) are written into one bytes
object: prefix, JSON-escaped text, suffix.  Cold events share the pure
twin's dict building, so both twins emit identical bytes.  ``dumps`` (the
other wire APIs' events: Anthropic, Responses, Completions) writes dicts,
lists, tuples, exact strings, ints, floats, booleans and None itself and
hands anything else (a subclass, a non-string key, deep nesting) to the pure
twin's encoder: the same bytes as ``json.dumps(obj, ensure_ascii=False,
separators=(",", ":"))``.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcpy

from afm_core._stream.events import ContentDelta as _CD
from afm_core._stream.events import LogprobsDelta as _LD
from afm_core._stream.events import ReasoningDelta as _RD
from afm_core._stream.events import ToolCallDelta as _TD
from afm_core._stream.sse_py import DONE
from afm_core._stream.sse_py import dumps as _py_dumps
from afm_core._stream.sse_py import SSEEncoder as _PySSEEncoder

__all__ = ["DONE", "SSEEncoder", "dumps", "escape_json_string", "frame"]

cdef extern from "Python.h":
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    int PyUnicode_KIND(object)
    void* PyUnicode_DATA(object)
    unsigned int PyUnicode_READ(int kind, void* data, Py_ssize_t i)
    int PyUnicode_1BYTE_KIND

cdef const char* HEX = b"0123456789abcdef"

# 0: plain; 1: short escape (\n ...); 2: \u00XX.  Index by byte < 0x80.
cdef unsigned char ESC[128]
cdef char SHORT[128]
cdef int _i
for _i in range(128):
    ESC[_i] = 0
    SHORT[_i] = 0
for _i in range(32):
    ESC[_i] = 2
for _i, _c in ((8, b"b"), (9, b"t"), (10, b"n"), (12, b"f"), (13, b"r"), (34, b'"'), (92, b"\\")):
    ESC[_i] = 1
    SHORT[_i] = _c[0]


cdef Py_ssize_t _escaped_size(str text) except -1:
    """Bytes of the escaped body (without quotes)."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef int kind = PyUnicode_KIND(text)
    cdef void* data = PyUnicode_DATA(text)
    cdef const unsigned char* p
    cdef Py_ssize_t i, size = n
    cdef unsigned int c
    if kind == PyUnicode_1BYTE_KIND:
        p = <const unsigned char*>data
        for i in range(n):
            c = p[i]
            if c < 0x80:
                if ESC[c]:
                    size += 1 if ESC[c] == 1 else 5
            else:
                size += 1
        return size
    for i in range(n):
        c = PyUnicode_READ(kind, data, i)
        if c < 0x80:
            if ESC[c]:
                size += 1 if ESC[c] == 1 else 5
        elif c < 0x800:
            size += 1
        elif 0xD800 <= c <= 0xDFFF:
            size += 5
        elif c < 0x10000:
            size += 2
        else:
            size += 3
    return size


cdef inline char* _put_u(char* q, unsigned int c) noexcept:
    q[0] = b"\\"
    q[1] = b"u"
    q[2] = HEX[(c >> 12) & 15]
    q[3] = HEX[(c >> 8) & 15]
    q[4] = HEX[(c >> 4) & 15]
    q[5] = HEX[c & 15]
    return q + 6


cdef char* _write_escaped(char* q, str text) noexcept:
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef int kind = PyUnicode_KIND(text)
    cdef void* data = PyUnicode_DATA(text)
    cdef Py_ssize_t i
    cdef unsigned int c
    for i in range(n):
        c = PyUnicode_READ(kind, data, i)
        if c < 0x80:
            if ESC[c] == 0:
                q[0] = <char>c
                q += 1
            elif ESC[c] == 1:
                q[0] = b"\\"
                q[1] = SHORT[c]
                q += 2
            else:
                q = _put_u(q, c)
        elif c < 0x800:
            q[0] = <char>(0xC0 | (c >> 6))
            q[1] = <char>(0x80 | (c & 0x3F))
            q += 2
        elif 0xD800 <= c <= 0xDFFF:
            q = _put_u(q, c)
        elif c < 0x10000:
            q[0] = <char>(0xE0 | (c >> 12))
            q[1] = <char>(0x80 | ((c >> 6) & 0x3F))
            q[2] = <char>(0x80 | (c & 0x3F))
            q += 3
        else:
            q[0] = <char>(0xF0 | (c >> 18))
            q[1] = <char>(0x80 | ((c >> 12) & 0x3F))
            q[2] = <char>(0x80 | ((c >> 6) & 0x3F))
            q[3] = <char>(0x80 | (c & 0x3F))
            q += 4
    return q


cdef bytes _build(bytes a, bytes b, str text, bytes tail):
    """``a + b + escape(text) + tail`` in one allocation."""
    cdef Py_ssize_t na = PyBytes_GET_SIZE(a), nb = PyBytes_GET_SIZE(b)
    cdef Py_ssize_t nt = PyBytes_GET_SIZE(tail)
    cdef Py_ssize_t body = _escaped_size(text)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, na + nb + body + 2 + nt)
    cdef char* q = PyBytes_AS_STRING(out)
    cdef Py_ssize_t n
    memcpy(q, PyBytes_AS_STRING(a), na)
    q += na
    memcpy(q, PyBytes_AS_STRING(b), nb)
    q += nb
    q[0] = b'"'
    q += 1
    if body == PyUnicode_GET_LENGTH(text) and PyUnicode_KIND(text) == PyUnicode_1BYTE_KIND:
        # Nothing to escape and every char is ASCII (size would grow otherwise).
        n = body
        memcpy(q, PyUnicode_DATA(text), n)
        q += n
    else:
        q = _write_escaped(q, text)
    q[0] = b'"'
    q += 1
    memcpy(q, PyBytes_AS_STRING(tail), nt)
    return out


def escape_json_string(str text) -> bytes:
    """``text`` as a quoted JSON string literal in UTF-8."""
    return _build(b"", b"", text, b"")


cdef int MAX_DEPTH = 64  # deeper: the pure twin (which also detects cycles)
cdef double INF = float("inf")


cdef int _dump(list out, object obj, int depth) except -1:
    """Append ``obj``'s compact JSON to ``out`` (bytes pieces)."""
    cdef type t = type(obj)
    cdef bint first
    cdef Py_ssize_t mark
    if t is str:
        out.append(_build(b"", b"", <str>obj, b""))
    elif obj is None:
        out.append(b"null")
    elif obj is True:
        out.append(b"true")
    elif obj is False:
        out.append(b"false")
    elif t is int:
        out.append(int.__repr__(obj).encode("ascii"))
    elif t is float:
        if obj != obj:
            out.append(b"NaN")
        elif obj == INF:
            out.append(b"Infinity")
        elif obj == -INF:
            out.append(b"-Infinity")
        else:
            out.append(float.__repr__(obj).encode("ascii"))
    elif t is dict and depth < MAX_DEPTH:
        mark = len(out)
        out.append(b"{")
        first = True
        for k, v in (<dict>obj).items():
            if type(k) is not str:  # json's key conversions: the pure twin's
                del out[mark:]
                out.append(_py_dumps(obj))
                return 0
            out.append(_build(b"" if first else b",", b"", <str>k, b":"))
            first = False
            _dump(out, v, depth + 1)
        out.append(b"}")
    elif (t is list or t is tuple) and depth < MAX_DEPTH:
        out.append(b"[")
        first = True
        for v in obj:
            if not first:
                out.append(b",")
            first = False
            _dump(out, v, depth + 1)
        out.append(b"]")
    else:
        out.append(_py_dumps(obj))
    return 0


def dumps(obj) -> bytes:
    """Compact UTF-8 JSON of ``obj`` (lone surrogates escaped): exactly
    ``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))``."""
    cdef list out = []
    _dump(out, obj, 0)
    return b"".join(out)


def frame(obj) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + dumps(obj) + b"\n\n"


cdef bytes ROLE = b'"role":"assistant",'
cdef bytes CONTENT = b'"content":'
cdef bytes REASONING = b'"reasoning_content":'
cdef bytes EMPTY = b""
cdef object ContentDelta = _CD
cdef object ReasoningDelta = _RD
cdef object ToolCallDelta = _TD
cdef object LogprobsDelta = _LD


cdef class SSEEncoder:
    """Encode one stream's events as ``chat.completion.chunk`` SSE frames.

    The first choice chunk carries ``delta.role: "assistant"``.  A
    ``LogprobsDelta`` directly after a content/reasoning delta in one
    :meth:`encode_many` batch rides in that delta's chunk.  ``index`` is the
    choice the stream is (``choices[0].index``).
    """

    cdef object _cold
    cdef bytes _top
    cdef bytes _tail
    cdef bytes _args_tail
    cdef Py_ssize_t _tool_index
    cdef bytes _tool_prefix
    cdef bint _role_sent

    def __init__(self, str id, created, str model, *, system_fingerprint=None, index=0):
        self._cold = _PySSEEncoder(id, created, model, system_fingerprint=system_fingerprint,
                                   index=index)
        self._top = self._cold._top
        self._tail = self._cold._tail
        self._args_tail = b"}}]" + self._tail
        self._tool_index = -1
        self._tool_prefix = EMPTY
        self._role_sent = False

    @property
    def id(self):
        return self._cold.id

    @property
    def created(self):
        return self._cold.created

    @property
    def model(self):
        return self._cold.model

    @property
    def system_fingerprint(self):
        return self._cold.system_fingerprint

    @property
    def index(self):
        return self._cold.index

    cdef inline bint _take_role(self) except -1:
        # The role state lives in the cold encoder; cache "already sent".
        if self._role_sent:
            return False
        self._role_sent = True
        if self._cold._role_pending:
            self._cold._role_pending = False
            return True
        return False

    cdef inline bytes _text_frame(self, bytes key, str text):
        if self._take_role():
            return _build(self._top, ROLE + key, text, self._tail)
        return _build(self._top, key, text, self._tail)

    cpdef bytes encode(self, event):
        """One SSE frame for ``event``."""
        cdef object kind = type(event)
        cdef Py_ssize_t index
        if kind is ContentDelta:
            return self._text_frame(CONTENT, event.text)
        if kind is ReasoningDelta:
            return self._text_frame(REASONING, event.text)
        if kind is ToolCallDelta and event.id is None and event.name is None:
            if not self._role_sent and self._cold._role_pending:
                return frame(self._cold.chunk(event))
            self._role_sent = True
            index = event.index
            if index != self._tool_index:
                self._tool_index = index
                self._tool_prefix = b'"tool_calls":[{"index":%d,"function":{"arguments":' % index
            return _build(self._top, self._tool_prefix, event.arguments, self._args_tail)
        return frame(self._cold.chunk(event))

    def encode_many(self, events) -> bytes:
        """The frames of one step's events as one bytes object."""
        cdef list items = events if type(events) is list else list(events)
        cdef Py_ssize_t i = 0, n = len(items)
        cdef list out
        if n == 1:
            return self.encode(items[0])
        out = []
        while i < n:
            event = items[i]
            if (
                i + 1 < n
                and type(items[i + 1]) is LogprobsDelta
                and (type(event) is ContentDelta or type(event) is ReasoningDelta)
            ):
                for c in self._cold.chunks(items[i : i + 2]):
                    out.append(frame(c))
                i += 2
                continue
            out.append(self.encode(event))
            i += 1
        return b"".join(out)

    def chunk(self, event):
        """The chunk object for ``event`` (advances the role state)."""
        return self._cold.chunk(event)

    def chunks(self, events):
        """Chunk objects for a batch, merging logprobs as :meth:`encode_many` does."""
        return self._cold.chunks(events)

    def done(self) -> bytes:
        """The transport terminator ``data: [DONE]``."""
        return DONE
