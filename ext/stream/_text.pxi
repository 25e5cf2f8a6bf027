# Shared by the Cython twins (``include "_text.pxi"``); twin of ``afm_core/_stream/text.py``.

cdef Py_ssize_t _partial(str text, str tag):
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    cdef Py_ssize_t n = len(text)
    cdef Py_ssize_t m = len(tag)
    cdef Py_ssize_t lo = n - m + 1
    cdef Py_ssize_t i, j
    cdef Py_UCS4 first
    if m == 0:
        return 0
    first = tag[0]
    if lo < 0:
        lo = 0
    for i in range(lo, n):
        if text[i] != first:
            continue
        j = 1
        while i + j < n and text[i + j] == tag[j]:
            j += 1
        if i + j == n:
            return n - i
    return 0
