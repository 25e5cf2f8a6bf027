"""afm's GGUF header reader against ``gguf.GGUFReader`` (llama.cpp's gguf-py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from afm_core._errors import GGUFError
from afm_core._models.gguf.reader import read_gguf_info, tensor_bytes

from .test_gguf_archs import build


def _their_value(field: gguf.ReaderField) -> object:
    main = field.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return np.array([field.parts[i][0] for i in field.data])
    if main == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    return field.parts[-1][0]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "qwen3moe"])
def test_reader_agrees_with_gguf_reader(tmp_path: Path, arch: str) -> None:
    m, _ = build(arch)
    path = m.write(tmp_path / "m.gguf")
    ours = read_gguf_info(path)
    theirs = gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for k in keys:
        want, got = _their_value(theirs.fields[k]), ours.metadata[k]
        if isinstance(want, np.ndarray):
            assert np.array_equal(np.asarray(got), want), k
        else:
            assert got == want, k
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.type_name) == (t.name, t.tensor_type.name)
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert mine.n_bytes == t.n_bytes
        assert ours.data_offset + mine.offset == t.data_offset
        data = np.asarray(tensor_bytes(ours, mine))
        assert data.tobytes() == np.asarray(t.data).tobytes(), t.name


def test_tensor_bytes_refuses_truncated_data(tmp_path: Path) -> None:
    m, _ = build("qwen2")
    path = m.write(tmp_path / "m.gguf")
    info = read_gguf_info(path)
    last = max(info.tensors, key=lambda t: t.offset)
    path.write_bytes(path.read_bytes()[: info.data_offset + last.offset + 10])
    info = read_gguf_info(path)
    with pytest.raises(GGUFError, match="truncated"):
        tensor_bytes(info, last)
