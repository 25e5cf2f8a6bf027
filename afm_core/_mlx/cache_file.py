"""One prefix-cache entry as a file: mlx-lm's prompt-cache format, checksummed.

The layout is exactly what ``mlx_lm.models.cache.save_prompt_cache`` writes
(a safetensors file: the flattened ``[c.state for c in cache]`` arrays, the
non-array state (offsets, sizes) as small arrays, and the metadata
``[metadata, classes, scalars]`` flattened into string pairs), so
``load_prompt_cache`` and ``mx.load`` read it too.  afm's own fields sit in
the ``metadata`` dict (``0.afm_kv``, ``0.model``, ``0.tokens``,
``0.trimmable``, ``0.checksum``).  A quantized cache (``EngineConfig.kv_bits``)
is mlx-lm's ``QuantizedKVCache`` state: each layer's keys and values as
``(data, scales, biases)`` arrays, then its offset, group size and bits.

Why not ``mx.save_safetensors``: the file is written on a background thread,
and an MLX call there could need a stream (a non-contiguous array is copied
by an MLX operation first), which exists only on the generation thread.  The
bytes of an array that has been evaluated (or is being evaluated,
``mx.async_eval``) are readable from any thread through the buffer protocol
(``memoryview``); so the writer is plain Python over those buffers, and
reading builds ``mx.array`` objects from bytes (no operation, no stream).

**The checksum** (``0.checksum``, ``sha256:<hex>``) covers the metadata
(every key but the checksum, as sorted compact JSON: the token ids and the
model's fingerprint included) and each tensor's name, dtype, shape and bytes,
in name order; :func:`read_entry` recomputes it over the whole file before
anything is built from it.  A truncated file, a flipped byte or a header that
no longer parses raises :class:`CorruptEntry`.

May import: mlx, mlx-lm, numpy and the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FORMAT", "CorruptEntry", "EntryHeader", "Tensor", "build_cache", "encode_cache", "read_entry",
           "read_header", "write_entry"]

FORMAT = "1"
"""``0.afm_kv``: the version of the fields below; another version is not read."""

_HEADER_LIMIT = 64 << 20  # a header longer than this is not one of ours

# mlx dtype name -> (safetensors dtype, numpy dtype to read it as)
_DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("F32", "<f4"), "float16": ("F16", "<f2"), "bfloat16": ("BF16", "<u2"),
    "float64": ("F64", "<f8"), "int8": ("I8", "i1"), "int16": ("I16", "<i2"), "int32": ("I32", "<i4"),
    "int64": ("I64", "<i8"), "uint8": ("U8", "u1"), "uint16": ("U16", "<u2"), "uint32": ("U32", "<u4"),
    "uint64": ("U64", "<u8"), "bool": ("BOOL", "?"),
}
_FROM_SAFETENSORS = {st: (mlx, npd) for mlx, (st, npd) in _DTYPES.items()}


class CorruptEntry(Exception):
    """The file is not a complete, intact entry (truncated, altered, unreadable)."""


@dataclass(frozen=True, slots=True)
class Tensor:
    """One array to write: its safetensors dtype and shape, and its bytes
    (any buffer: an evaluated ``mx.array`` or a numpy array)."""

    dtype: str
    shape: tuple[int, ...]
    data: Any


@dataclass(frozen=True, slots=True)
class EntryHeader:
    """What the header of an entry file says (read without its tensors)."""

    metadata: dict[str, str]
    tokens: tuple[int, ...]
    model: str
    trimmable: bool
    size: int
    """The file's size in bytes."""


def _mx_dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1].rstrip("_")


def encode_cache(cache: list[Any]) -> tuple[dict[str, Any], list[str], list[Any]]:
    """``cache``'s state as save_prompt_cache flattens it: the arrays by name
    (the ``mx.array`` objects themselves, or numpy arrays for the non-array
    state), the cache classes, and the scalars' record.  No MLX operation:
    safe on the generation thread between steps, cheap."""
    from mlx.utils import tree_flatten

    scalars: list[Any] = [""]  # save_prompt_cache's sentinel: never empty
    arrays: dict[str, Any] = {}
    flat: list[tuple[str, Any]] = tree_flatten([c.state for c in cache])  # type: ignore[assignment]
    for name, value in flat:
        if isinstance(value, bool):
            scalars.append((name, "scalar"))
            arrays[name] = np.array(value)
        elif isinstance(value, int):
            scalars.append((name, "scalar"))
            arrays[name] = np.array(value, dtype=np.int32)
        elif isinstance(value, float):
            scalars.append((name, "scalar"))
            arrays[name] = np.array(value, dtype=np.float32)
        elif isinstance(value, str):
            scalars.append((name, "string"))
            arrays[name] = np.array([ord(ch) for ch in value], dtype=np.int32)
        elif value is None:
            scalars.append((name, "none"))
            arrays[name] = np.zeros((0,), dtype=np.float32)
        elif hasattr(value, "dtype") and hasattr(value, "shape"):
            arrays[name] = value
        else:
            raise ValueError(f"a prompt cache state of type {type(value).__name__} is not serializable")
    return arrays, [type(c).__name__ for c in cache], scalars


def _tensor(value: Any) -> Tensor:
    """``value`` (an evaluated mx.array or a numpy array) as bytes to write;
    safe off the generation thread (the buffer protocol waits for an array
    still being evaluated by ``mx.async_eval``)."""
    if isinstance(value, np.ndarray):
        name = "bool" if value.dtype == np.bool_ else str(value.dtype)
        contiguous: Any = np.ascontiguousarray(value)
        return Tensor(_DTYPES[name][0], tuple(value.shape), memoryview(contiguous).cast("B"))
    view = memoryview(value)
    data = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    return Tensor(_DTYPES[_mx_dtype_name(value.dtype)][0], tuple(value.shape), data)


def _digest(metadata: dict[str, str], tensors: Iterable[tuple[str, str, tuple[int, ...], Any]]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in metadata.items() if k != "0.checksum"},
                        sort_keys=True, separators=(",", ":")).encode())
    for name, dtype, shape, data in tensors:
        h.update(f"\n{name}\0{dtype}\0{list(shape)}\n".encode())
        h.update(data)
    return "sha256:" + h.hexdigest()


def write_entry(path: Path, arrays: dict[str, Any], classes: list[str], scalars: list[Any],
                fields: dict[str, str]) -> int:
    """Write the entry atomically (a temporary file in the same directory,
    then a rename) and return its size.  ``fields`` are afm's metadata
    fields (``model``, ``tokens``, ``trimmable``); the format and the checksum
    are added here.  Runs off the generation thread: no MLX call."""
    from mlx.utils import tree_flatten

    tensors = {name: _tensor(value) for name, value in arrays.items()}
    user = {"afm_kv": FORMAT, **fields}
    flat: list[tuple[str, Any]] = tree_flatten([user, classes, scalars])  # type: ignore[assignment]
    metadata = {k: str(v) for k, v in flat}
    names = sorted(tensors)
    metadata["0.checksum"] = _digest(metadata, ((n, tensors[n].dtype, tensors[n].shape, tensors[n].data)
                                                for n in names))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        t = tensors[name]
        size = t.data.nbytes
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the tensors start 8-byte aligned
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name in names:
                f.write(tensors[name].data)
        # no fsync: a killed process leaves the page cache to the kernel, and
        # what a power loss garbles fails the checksum on its next read
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return 8 + len(raw) + offset


def _parse_header(raw: bytes, size: int) -> tuple[dict[str, Any], int]:
    """The header dict and where the tensors start; CorruptEntry if it is not whole."""
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CorruptEntry(f"the header does not parse: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CorruptEntry("the header has no metadata")
    start = 8 + len(raw)
    end = 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            _, hi = spec["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CorruptEntry(f"tensor {name!r} has no data offsets") from None
        end = max(end, int(hi))
    if start + end != size:
        raise CorruptEntry(f"the file has {size} bytes, its header describes {start + end} (truncated?)")
    return header, start


def read_header(path: Path) -> EntryHeader:
    """The entry's header, read without its tensors (for the index at start):
    the file's length is checked against it, so a truncated file is found
    here; a flipped byte in a tensor only when :func:`read_entry` checks the
    checksum.  ``KeyError`` if the file is a safetensors file but not an afm
    entry of this format."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CorruptEntry("shorter than a header")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_LIMIT or 8 + n > size:
            raise CorruptEntry(f"a header of {n} bytes in a file of {size}")
        raw = f.read(n)
    header, _ = _parse_header(raw, size)
    return _entry_header(header["__metadata__"], size)


def _entry_header(metadata: dict[str, str], size: int) -> EntryHeader:
    if metadata.get("0.afm_kv") != FORMAT:
        raise KeyError("0.afm_kv")
    try:
        tokens = tuple(int(t) for t in json.loads(metadata["0.tokens"]))
        return EntryHeader(metadata, tokens, metadata["0.model"], metadata["0.trimmable"] == "1", size)
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptEntry(f"bad afm metadata: {exc!r}") from None


def read_entry(path: Path) -> tuple[EntryHeader, dict[str, Any], list[str], list[Any]]:
    """Read and check the whole entry: its header, its arrays (``mx.array``
    objects built from the file's bytes, bfloat16 ones as uint16 for
    :func:`build_cache` to reinterpret), classes and scalars' record.  Runs
    off the generation thread.  CorruptEntry if the checksum fails or the
    file is not whole; OSError if it cannot be read (gone)."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    with open(path, "rb") as f:
        buf = f.read()
    if len(buf) < 8:
        raise CorruptEntry("shorter than a header")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > _HEADER_LIMIT or 8 + n > len(buf):
        raise CorruptEntry(f"a header of {n} bytes in a file of {len(buf)}")
    header, start = _parse_header(buf[8:8 + n], len(buf))
    metadata: dict[str, str] = header.pop("__metadata__")
    entry = _entry_header(metadata, len(buf))
    view = memoryview(buf)
    specs: dict[str, tuple[str, tuple[int, ...], memoryview]] = {}
    try:
        for name, spec in header.items():
            lo, hi = (start + int(x) for x in spec["data_offsets"])
            if not start <= lo <= hi <= len(buf):
                raise ValueError(f"offsets {lo}-{hi} outside the file")
            specs[name] = (str(spec["dtype"]), tuple(int(d) for d in spec["shape"]), view[lo:hi])
    except (TypeError, KeyError, ValueError) as exc:
        raise CorruptEntry(f"bad tensor header: {exc!r}") from None
    digest = _digest(metadata, ((k, *specs[k]) for k in sorted(specs)))
    if digest != metadata.get("0.checksum"):
        raise CorruptEntry("the checksum does not match its contents")
    arrays: dict[str, Any] = {}
    for name, (dtype, shape, data) in specs.items():
        if dtype not in _FROM_SAFETENSORS:
            raise CorruptEntry(f"unknown dtype {dtype}")
        mlx_name, np_dtype = _FROM_SAFETENSORS[dtype]
        itemsize = np.dtype(np_dtype).itemsize
        count = int(np.prod(shape)) if shape else 1
        if count * itemsize != data.nbytes:
            raise CorruptEntry(f"tensor {name!r}: {data.nbytes} bytes for shape {shape}")
        array = np.frombuffer(data, dtype=np_dtype).reshape(shape)
        if not array.flags.aligned:  # (after a tensor of an odd size)
            array = array.copy()
        # a numpy array -> mx.array is a copy into MLX's allocator: no operation, no stream
        arrays[name] = (mx.array(array), mlx_name == "bfloat16")
    unflat = tree_unflatten(list(metadata.items()))
    _, classes, scalars = unflat
    return entry, arrays, list(classes), list(scalars)


def build_cache(arrays: dict[str, Any], classes: list[str], scalars: list[Any]) -> list[Any]:
    """The cache objects (``from_state`` of each class, as
    ``load_prompt_cache`` builds them) from :func:`read_entry`'s parts; on
    the generation thread (a bfloat16 reinterpretation is an MLX operation)."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.models import cache as cache_module

    from .quantized_cache import QuantizedKVCache

    values: dict[str, Any] = {name: (a.view(mx.bfloat16) if bf16 else a) for name, (a, bf16) in arrays.items()}
    for pos, kind in scalars[1:]:
        array = values[pos]
        if kind == "scalar":
            values[pos] = array.item()
        elif kind == "string":
            values[pos] = "".join(chr(i) for i in array.tolist())
        elif kind == "none":
            values[pos] = None
        else:
            raise CorruptEntry(f"unknown scalar kind {kind!r}")
    states = tree_unflatten(list(values.items()))
    built = []
    for name, state in zip(classes, states, strict=True):
        # afm's batchable subclass under mlx-lm's name (see .quantized_cache)
        cls = QuantizedKVCache if name == "QuantizedKVCache" else getattr(cache_module, name, None)
        if not (isinstance(cls, type) and issubclass(cls, cache_module._BaseCache)):
            raise CorruptEntry(f"unknown cache class {name!r}")
        built.append(cls.from_state(state))
    return built
