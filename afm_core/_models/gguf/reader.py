"""A fast reader for GGUF headers, and zero-copy views of the tensor data.

The tensor types, their block sizes and byte sizes come from the ``gguf``
package (llama.cpp's own ``gguf-py``: :class:`gguf.GGMLQuantizationType`,
``gguf.GGML_QUANT_SIZES``).  The header parser stays here because
``gguf.GGUFReader`` builds one numpy part per array element: on
Qwen2.5's 151,936-token vocabulary it takes about 25x longer than this one
(21 s against 0.8 s on a loaded 2-core machine), and afm reads headers on
every ``--model FILE.gguf`` start.  ``tests/models/test_gguf_reader.py``
checks that both readers agree on every key and tensor of the files the
tests write.

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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..._errors import GGUFError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

#: GGML tensor types: id -> name (llama.cpp's table, from the ``gguf`` package).
GGML_TYPES: dict[int, str] = {int(t): t.name for t in GGMLQuantizationType}
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

    @property
    def block(self) -> tuple[int, int]:
        """(values per block, bytes per block) of the tensor's type."""
        try:
            return GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        except (ValueError, KeyError):
            raise GGUFError(f"tensor {self.name!r} has unknown GGML type {self.ggml_type}") from None

    @property
    def n_bytes(self) -> int:
        """Bytes of the tensor's data."""
        per_block, size = self.block
        n = int(np.prod(self.shape))
        if self.shape and self.shape[-1] % per_block:
            raise GGUFError(
                f"tensor {self.name!r}: row length {self.shape[-1]} is not a multiple of "
                f"{self.type_name}'s block of {per_block}"
            )
        return n // per_block * size


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

    def tensor(self, name: str) -> TensorInfo | None:
        """The tensor called ``name``, or None."""
        return next((t for t in self.tensors if t.name == name), None)

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


def tensor_bytes(info: GGUFInfo, t: TensorInfo) -> np.ndarray:
    """``t``'s data as a read-only memory map: one uint8 row per GGML block
    (``(n_blocks, block_bytes)``), or the values themselves for F32/F16
    (in the tensor's numpy shape)."""
    start = info.data_offset + t.offset
    n = t.n_bytes
    try:
        size = os.path.getsize(info.path)
    except OSError as exc:
        raise GGUFError(f"cannot read GGUF file {info.path}: {exc}") from exc
    if start + n > size:
        raise GGUFError(f"{info.path}: truncated GGUF file (tensor {t.name!r} ends past the end)")
    raw = np.memmap(info.path, dtype=np.uint8, mode="r", offset=start, shape=(n,))
    if t.type_name == "F32":
        return raw.view("<f4").reshape(t.shape)
    if t.type_name == "F16":
        return raw.view("<f2").reshape(t.shape)
    return raw.reshape(-1, t.block[1])
