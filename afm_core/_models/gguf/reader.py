"""A small, pure reader for GGUF headers: metadata and tensor descriptions.

It never touches tensor data (``mlx.core.load`` reads that); it exists so the
importer knows each tensor's GGML type *before* loading, and can refuse
unsupported files with a message naming what is unsupported instead of letting
MLX silently dequantize or fail deep inside C++.

Layout (little-endian)::

    "GGUF" u32:version u64:n_tensors u64:n_kv
    n_kv      x (string:key, u32:value_type, value)
    n_tensors x (string:name, u32:n_dims, u64[n_dims]:ne, u32:ggml_type, u64:offset)
    padding to general.alignment (default 32), then tensor data

``ne`` lists dimensions innermost first; :attr:`TensorInfo.shape` is reversed
into numpy/MLX order (rows, columns).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ..._errors import GGUFError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGML tensor types: id -> name.  Only some are supported by the importer.
GGML_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
    9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
    15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
    26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
GGML_TYPE_IDS: dict[str, int] = {v: k for k, v in GGML_TYPES.items()}

# GGUF metadata value types.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(8, 13)

_SCALARS: dict[int, str] = {
    _UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I",
    _INT32: "<i", _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q",
    _FLOAT64: "<d",
}  # fmt: skip
_NUMPY: dict[int, str] = {
    _UINT8: "<u1", _INT8: "<i1", _UINT16: "<u2", _INT16: "<i2", _UINT32: "<u4",
    _INT32: "<i4", _FLOAT32: "<f4", _BOOL: "?", _UINT64: "<u8", _INT64: "<i8",
    _FLOAT64: "<f8",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's description from the GGUF header."""

    name: str
    shape: tuple[int, ...]  # numpy order: outermost first
    ggml_type: int
    offset: int  # relative to the start of the data section

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, f"unknown type {self.ggml_type}")


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """A GGUF file's header: version, metadata and tensor descriptions."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


class _Cursor:
    """Sequential little-endian reads from a buffered file, with bounds checks."""

    def __init__(self, f: BinaryIO, path: str, size: int):
        self.f = f
        self.path = path
        self.size = size

    def take(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise GGUFError(
                f"{self.path}: truncated GGUF header (wanted {n} bytes at {self.f.tell()})"
            )
        return self.f.read(n)

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        # Some vocabularies hold pieces that are not valid UTF-8 on their own.
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar("<I")
            count = self.scalar("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                return np.frombuffer(self.take(count * dt.itemsize), dtype=dt).copy()
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            raise GGUFError(f"{self.path}: unknown GGUF array element type {etype}")
        raise GGUFError(f"{self.path}: unknown GGUF metadata value type {vtype}")


def read_gguf_info(path: str | os.PathLike[str]) -> GGUFInfo:
    """Parse the header of the GGUF file at ``path``.

    Raises :class:`GGUFError` for a file that is not GGUF, is truncated, or
    uses a GGUF version other than 2 or 3.
    """
    spath = os.fspath(path)
    try:
        f = open(spath, "rb", buffering=1 << 20)  # noqa: SIM115 - closed below
    except OSError as exc:
        raise GGUFError(f"cannot open GGUF file {spath}: {exc}") from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFError(f"{spath}: not a GGUF file (only {size} bytes)")
        return _parse(_Cursor(f, spath, size))


def _parse(cur: _Cursor) -> GGUFInfo:
    path = cur.path
    magic = cur.take(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r})")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.scalar("<Q")
    n_kv = cur.scalar("<Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise GGUFError(f"{path}: implausible GGUF header ({n_tensors} tensors, {n_kv} keys)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        if n_dims > 8:
            raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        ne = [cur.scalar("<Q") for _ in range(n_dims)]
        ggml_type = cur.scalar("<I")
        offset = cur.scalar("<Q")
        tensors.append(TensorInfo(name, tuple(reversed(ne)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT) or DEFAULT_ALIGNMENT)
    data_offset = -(-cur.f.tell() // alignment) * alignment
    if data_offset > cur.size:
        raise GGUFError(f"{path}: truncated GGUF file (no tensor data)")
    return GGUFInfo(path, version, metadata, tuple(tensors), data_offset)
