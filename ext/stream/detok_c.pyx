# cython: language_level=3
"""Incremental detokenizer (Cython twin of ``afm_core._stream.detok_py``)."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM

from afm_core._stream.detok_tables import DecoderTables

__all__ = ["DecoderTables", "IncrementalDetokenizer"]

cdef extern from "Python.h":
    object PyUnicode_DecodeUTF8Stateful(const char* s, Py_ssize_t size, const char* errors, Py_ssize_t* consumed)
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)

cdef enum:
    SKIP = 0
    TEXT = 1
    RAW = 2
    BYTE = 3

cdef str REPLACEMENT = "\ufffd"


cdef class IncrementalDetokenizer:
    """Stream-decode one sequence; build ``tables`` once per tokenizer and share them."""

    cdef readonly object tables
    cdef bint _spm
    cdef bytes _kinds_obj
    cdef const unsigned char* _kinds
    cdef bytes _bytevals_obj
    cdef const unsigned char* _bytevals
    cdef list _texts
    cdef list _raws
    cdef dict _first_texts
    cdef Py_ssize_t _size
    cdef bytes _pending
    cdef bytearray _run
    cdef bint _first
    cdef Py_ssize_t _strip_left
    cdef str _strip_char

    def __init__(self, tables, *, skip_special_tokens=True):
        if not isinstance(tables, DecoderTables):
            tables = DecoderTables.from_tokenizer(tables, skip_special_tokens=skip_special_tokens)
        self.tables = tables
        self._spm = tables.mode == "sentencepiece"
        self._kinds_obj = tables.kinds
        self._kinds = <const unsigned char*>PyBytes_AS_STRING(self._kinds_obj)
        self._bytevals_obj = tables.bytevals
        self._bytevals = <const unsigned char*>PyBytes_AS_STRING(self._bytevals_obj)
        self._texts = tables.texts
        self._raws = tables.raws
        self._first_texts = tables.first_texts
        self._size = PyBytes_GET_SIZE(self._kinds_obj)
        self._strip_char = tables.strip_char
        self._run = bytearray()
        self.reset()

    def reset(self):
        """Forget the stream (keep the tables)."""
        self._pending = b""
        del self._run[:]
        self._first = True
        self._strip_left = self.tables.strip_count

    cpdef str feed(self, Py_ssize_t token_id):
        """The text that ``token_id`` completes (often all of it, maybe "")."""
        cdef unsigned char kind
        cdef str text
        cdef bytes data
        cdef Py_ssize_t used
        if token_id < 0 or token_id >= self._size:
            return ""
        kind = self._kinds[token_id]
        if kind == SKIP:
            return ""
        if self._spm:
            if kind == BYTE:
                self._first = False
                self._run.append(self._bytevals[token_id])
                return ""
            text = <str>PyList_GET_ITEM(self._texts, token_id)
            if self._first:
                self._first = False
                text = self._first_texts.get(token_id, text)
            if len(self._run):
                text = self._close_run() + text
            if self._strip_left:
                return self._strip(text)
            return text
        if kind == TEXT and PyBytes_GET_SIZE(self._pending) == 0:
            return <str>PyList_GET_ITEM(self._texts, token_id)
        if kind == RAW:
            data = self._pending + <bytes>PyList_GET_ITEM(self._raws, token_id)
        else:  # a TEXT id after held-back bytes: its bytes are its text's UTF-8
            data = self._pending + (<str>PyList_GET_ITEM(self._texts, token_id)).encode("utf-8")
        text = PyUnicode_DecodeUTF8Stateful(
            PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), "replace", &used
        )
        self._pending = data[used:]
        return text

    def feed_many(self, token_ids) -> str:
        """The text completed by several tokens."""
        cdef list parts = []
        cdef str text
        for t in token_ids:
            text = self.feed(t)
            if text:
                parts.append(text)
        return "".join(parts)

    cpdef str flush(self):
        """End of stream: whatever was held back (U+FFFD for incomplete bytes)."""
        cdef str text
        if self._spm:
            text = self._close_run() if len(self._run) else ""
            if self._strip_left:
                return self._strip(text)
            return text
        text = PyUnicode_DecodeUTF8(
            PyBytes_AS_STRING(self._pending), PyBytes_GET_SIZE(self._pending), "replace"
        )
        self._pending = b""
        return text

    cdef str _close_run(self):
        cdef bytes run = bytes(self._run)
        del self._run[:]
        try:
            return PyUnicode_DecodeUTF8(PyBytes_AS_STRING(run), PyBytes_GET_SIZE(run), "strict")
        except UnicodeDecodeError:
            return REPLACEMENT * PyBytes_GET_SIZE(run)

    cdef str _strip(self, str text):
        cdef Py_ssize_t limit = self._strip_left
        cdef Py_ssize_t n = len(text)
        cdef Py_ssize_t k = 0
        cdef Py_UCS4 char = self._strip_char[0]
        while k < limit and k < n and text[k] == char:
            k += 1
        if k == n and k < limit:
            self._strip_left -= k
        elif n:
            self._strip_left = 0
        return text[k:]
