"""The batched quantized KV cache (``afm_core._mlx.quantized_cache``) against
mlx-lm's single-sequence ``QuantizedKVCache``: rows of a batch (merged,
decoded, filtered, extended, extracted) give the logits each row gives alone
on its own quantized cache, and the caches round-trip through an entry file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import load_prompt_cache

from afm_core._mlx.cache_file import build_cache, encode_cache, read_entry, write_entry
from afm_core._mlx.disk_cache import model_fingerprint
from afm_core._mlx.quantized_cache import (
    BatchQuantizedKVCache,
    QuantizedKVCache,
    check_quantizable,
    make_quantized_cache,
)
from afm_core.testing import make_random_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 300, 301], [20, 21, 22], [30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # head size 64: a multiple of the default group size
    path = make_random_model(tmp_path_factory.mktemp("q"), hidden_size=256, num_heads=4, num_kv_heads=2)
    return load(str(path))[0]


def _prefilled(model: Any, prompt: list[int], bits: int) -> list[Any]:
    cache = make_quantized_cache(model, bits=bits, group_size=64)
    model(mx.array(prompt)[None], cache=cache)
    return cache


def _step_alone(model: Any, cache: list[Any], token: int) -> mx.array:
    return model(mx.array([[token]]), cache=cache)[0, -1]


@pytest.mark.parametrize("bits", [8, 4])
def test_batch_rows_match_single_caches(model: Any, bits: int) -> None:
    alone = [_prefilled(model, p[:-1], bits) for p in PROMPTS]
    batch = _merge_caches([_prefilled(model, p[:-1], bits) for p in PROMPTS])
    assert all(isinstance(c, BatchQuantizedKVCache) for c in batch)
    assert batch[0].size() == max(len(p) for p in PROMPTS) - 1
    tokens = [p[-1] for p in PROMPTS]
    for step in range(6):
        logits = model(mx.array(tokens)[:, None], cache=batch)[:, -1]
        for i, cache in enumerate(alone):
            ref = _step_alone(model, cache, tokens[i])
            assert mx.allclose(logits[i], ref, atol=1e-4).item(), (step, i)
        tokens = [(t * 7 + step) % 1000 + 3 for t in tokens]  # any next tokens, the same for both

    # a finished row leaves; the rest keep decoding; a new row joins
    for c in batch:
        c.filter([0, 2])
    kept = [alone[0], alone[2]]
    tokens = [tokens[0], tokens[2]]
    late = [40, 41, 42, 43]
    late_alone = _prefilled(model, late[:-1], bits)
    joined = _merge_caches([_prefilled(model, late[:-1], bits)])
    for a, b in zip(batch, joined, strict=True):
        a.extend(b)
    kept.append(late_alone)
    tokens.append(late[-1])
    for _ in range(3):
        logits = model(mx.array(tokens)[:, None], cache=batch)[:, -1]
        for i, cache in enumerate(kept):
            assert mx.allclose(logits[i], _step_alone(model, cache, tokens[i]), atol=1e-4).item()
        tokens = [t + 1 for t in tokens]

    # each row extracted holds what its own cache holds
    for i, cache in enumerate(kept):
        rows = [c.extract(i) for c in batch]
        assert all(isinstance(r, QuantizedKVCache) for r in rows)
        assert rows[0].offset == cache[0].offset
        n = cache[0].offset
        for r, c in zip(rows, cache, strict=True):
            for got, want in ((r.keys, c.keys), (r.values, c.values)):
                # the batch computed the keys with other float rounding: one quantization step apart at most
                a, b = (mx.dequantize(*(x[..., :n, :] for x in q), group_size=64, bits=bits) for q in (got, want))
                step = mx.abs(want[1][..., :n, :]).max()
                assert (mx.abs(a - b).max() <= step * 1.01).item()
        assert rows[0].nbytes == sum(x.nbytes for x in (*rows[0].keys, *rows[0].values))


def test_trim_and_empty(model: Any) -> None:
    batch = _merge_caches([make_quantized_cache(model, bits=8, group_size=64) for _ in range(2)])
    assert batch[0].empty() and batch[0].nbytes == 0
    full = _merge_caches([_prefilled(model, p, 8) for p in PROMPTS[:2]])
    assert full[0].trim(2) == 2 and full[0].size() == len(PROMPTS[0]) - 2
    assert full[0].nbytes > 0


def test_entry_file_round_trip(model: Any, tmp_path: Path) -> None:
    cache = _prefilled(model, PROMPTS[0], 4)
    mx.eval([c.state for c in cache])
    arrays, classes, scalars = encode_cache(cache)
    assert set(classes) == {"QuantizedKVCache"}
    path = tmp_path / "e.safetensors"
    write_entry(path, arrays, classes, scalars, {"model": "m", "tokens": "[1]", "trimmable": "1"})
    _, read, classes2, scalars2 = read_entry(path)
    built = build_cache(read, classes2, scalars2)
    assert all(type(c) is QuantizedKVCache and c.bits == 4 and c.group_size == 64 for c in built)
    for a, b in zip(built, cache, strict=True):
        assert a.offset == b.offset
        for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True):
            assert mx.array_equal(x, y).item()
    # the file is mlx-lm's prompt-cache format: its own loader reads it
    assert load_prompt_cache(str(path))[0].bits == 4
    # and the row batches again, decoding as the original
    merged = _merge_caches([built])
    assert mx.allclose(model(mx.array([[7]]), cache=merged)[0, -1], _step_alone(model, cache, 7), atol=1e-4).item()


def test_fingerprint_keys_the_kv_format(tmp_path: Path) -> None:
    plain = model_fingerprint(str(tmp_path))
    assert plain == model_fingerprint(str(tmp_path), "")
    assert len({plain, model_fingerprint(str(tmp_path), "q8g64"), model_fingerprint(str(tmp_path), "q4g64")}) == 3


def test_check_quantizable(model: Any, tmp_path: Path) -> None:
    check_quantizable(model, 64)
    small = load(str(make_random_model(tmp_path)))[0]  # head size 16
    with pytest.raises(ValueError, match="head size 16"):
        check_quantizable(small, 64)
