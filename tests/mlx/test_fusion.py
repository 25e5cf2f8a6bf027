"""Fused CPU kernels (afm_core._mlx.fusion) compute what mlx's layers compute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator

from afm_core._engine.engine import open_engine
from afm_core._mlx.attention import MAX_QUERY_POSITIONS
from afm_core._mlx.batch import install
from afm_core._mlx.blas import blas_info
from afm_core._mlx.fusion import (
    _FusedRMSNorm,
    _FusedRoPE,
    _HeadEmbedding,
    _TransposedLinear,
    fuse_cpu_kernels,
    one_operation_norm,
    transposes_help,
    unfuse_cpu_kernels,
    wants_fusion,
)
from afm_core._mlx.qmatmul import extension
from afm_core.api.chat_request import ChatRequest

pytestmark = pytest.mark.skipif(not wants_fusion(), reason="fusion applies to MLX's CPU backend")


def load(path: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(path))[0]


def test_every_plain_layer_is_switched_and_switched_back(random_model_dir: Path) -> None:
    model = load(random_model_dir)
    before = {k: mx.array(v) for k, v in tree_flatten(model.parameters())}

    def count(kind: type) -> int:
        return sum(type(m) is kind for _, m in model.named_modules())

    norms, ropes, linears = count(nn.RMSNorm), count(nn.RoPE), count(nn.Linear)
    assert norms and ropes and linears and count(nn.Embedding) == 1  # the tiny model ties its head
    layouts = 2 * len(model.layers)  # each block and its attention (afm_core._mlx.decode_layout)
    assert fuse_cpu_kernels(model, transpose=True) == norms + ropes + linears + 1 + layouts
    assert (count(_FusedRMSNorm), count(_FusedRoPE), count(_TransposedLinear), count(_HeadEmbedding)) == (
        norms, ropes, linears, 1)
    assert not (count(nn.RMSNorm) or count(nn.RoPE) or count(nn.Linear) or count(nn.Embedding))
    assert fuse_cpu_kernels(model, transpose=True) == 0  # already switched: nothing left to change
    # same bytes: the weights are transposed in place, the head's copy is not a parameter
    assert sum(v.nbytes for _, v in tree_flatten(model.parameters())) == sum(v.nbytes for v in before.values())
    assert unfuse_cpu_kernels(model) == norms + ropes + linears + 1 + layouts
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == before.keys()
    assert all(mx.array_equal(after[k], v).item() for k, v in before.items())
    assert count(nn.Linear) == linears and count(nn.Embedding) == 1


class _Projections(nn.Module):
    def __init__(self, head: bool) -> None:
        super().__init__()
        self.plain = nn.Linear(64, 1024, bias=False)
        self.biased = nn.Linear(128, 64, bias=True)
        self.embed = nn.Embedding(1024, 64)
        if head:
            self.lm_head = nn.Linear(64, 1024, bias=False)


def test_transposed_weights_compute_the_same_products() -> None:
    mx.random.seed(5)
    ref = _Projections(head=False)
    model = _Projections(head=False)
    model.update(ref.parameters())
    assert fuse_cpu_kernels(model, transpose=True) == 3
    assert model.plain.weight.shape == (64, 1024)
    # the reference BLAS sums a dot product in the same order either way: the
    # same bits; OpenBLAS picks another kernel for each order: a rounding apart
    same_bits = blas_info().name == "reference"
    for shape in [(1, 1, 64), (9, 1, 64), (2, 13, 64), (64, 64)]:
        x = mx.random.normal(shape)
        y = mx.random.normal((*shape[:-1], 128))
        for got, want in [(model.plain(x), ref.plain(x)),
                          (model.embed.as_linear(x), ref.embed.as_linear(x))]:
            if same_bits:
                assert mx.array_equal(got, want).item(), shape
            else:
                assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), shape
        # with a bias, the addition comes at another point: a rounding apart
        assert mx.allclose(model.biased(y), ref.biased(y), rtol=1e-6, atol=1e-6).item(), shape
    ids = mx.array([[0, 5, 1023]])
    assert mx.array_equal(model.embed(ids), ref.embed(ids)).item()  # lookups read the table itself
    untied = _Projections(head=True)
    assert fuse_cpu_kernels(untied, transpose=True) == 3  # the head has its own weight: no copy
    assert type(untied.embed) is nn.Embedding


def test_weights_are_transposed_only_for_the_reference_blas() -> None:
    model = _Projections(head=False)
    reference = blas_info().name == "reference"
    assert transposes_help() is reference
    assert fuse_cpu_kernels(model) == (3 if reference else 0)
    assert (type(model.plain) is nn.Linear) is not reference
    assert (type(model.embed) is nn.Embedding) is not reference


class _Holder(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_gemma_norms_are_fused_by_one_plus_their_weight(arch: str) -> None:
    """Gemma's ``rms_norm(x, 1 + weight)``: afm's norm kernels by ``1 +
    weight`` made once (one operation for float32 with the extension), the
    same ``1 + weight`` when the weight is given a new array; unfused, mlx-lm's
    class and call again."""
    import importlib

    base = importlib.import_module(f"mlx_lm.models.{arch}").RMSNorm
    mx.random.seed(5)
    norm = base(64, eps=1e-6)
    norm.weight = mx.random.normal((64,)) * 0.1
    fused = _Holder(base(64, eps=1e-6))
    fused.layer.weight = norm.weight
    assert fuse_cpu_kernels(fused) == 1
    layer = fused.layer
    assert type(layer) is not base and type(layer).__mro__[1] is base
    assert [k for k, _ in tree_flatten(fused.parameters())] == ["layer.weight"]  # (the 1 + weight is no parameter)
    for shape in [(1, 1, 64), (7, 1, 64), (2, 13, 64), (3, 4, 1, 64)]:  # decode, prefill, per-head norms
        x = mx.random.normal(shape)
        assert mx.allclose(layer(x), norm(x), rtol=1e-5, atol=1e-6).item(), shape
        half = x.astype(mx.float16)
        assert mx.allclose(layer(half), norm(half), rtol=1e-2, atol=1e-2).item()
    args = one_operation_norm(layer)
    if extension() is not None:
        assert args is not None and args[1] == pytest.approx(1e-6)
        assert mx.array_equal(args[0], 1.0 + norm.weight).item()
        x = mx.random.normal((2, 1, 64))
        assert mx.array_equal(layer(x), extension().rms_norm(x, 1.0 + norm.weight, 1e-6)).item()
    layer.weight = norm.weight * 2
    x = mx.random.normal((2, 1, 64))
    assert mx.allclose(layer(x), mx.fast.rms_norm(x, 1.0 + norm.weight * 2, 1e-6), rtol=1e-5, atol=1e-6).item()
    assert unfuse_cpu_kernels(fused) == 1
    assert type(layer) is base and one_operation_norm(layer) is None
    assert mx.array_equal(layer(x), mx.fast.rms_norm(x, 1.0 + norm.weight * 2, 1e-6)).item()


def test_fused_layers_match_mlx(random_model_dir: Path) -> None:
    mx.random.seed(3)
    norm = nn.RMSNorm(64, eps=1e-6)
    norm.weight = mx.random.normal((64,))
    fused = _Holder(nn.RMSNorm(64, eps=1e-6))
    fused.layer.weight = norm.weight
    assert fuse_cpu_kernels(fused) == 1
    for shape in [(1, 1, 64), (7, 1, 64), (2, 13, 64), (64,)]:  # decode, prefill, a single vector
        x = mx.random.normal(shape)
        assert mx.allclose(fused.layer(x), norm(x), rtol=1e-5, atol=1e-6).item(), shape
    offsets = mx.array([0, 5, 400, 4000, 30000])
    for dims, traditional, scale in [(16, False, 1.0), (16, True, 1.0), (8, False, 1.0), (8, True, 0.5)]:
        rope = nn.RoPE(dims, traditional=traditional, base=1e6, scale=scale)
        fused_rope = _Holder(nn.RoPE(dims, traditional=traditional, base=1e6, scale=scale))
        assert fuse_cpu_kernels(fused_rope) == 1
        # decode for q and k heads, a verify step, then a prefill chunk
        for heads, length in [(4, 1), (2, 1), (4, 3), (4, MAX_QUERY_POSITIONS + 1)]:
            x = mx.random.normal((5, heads, length, 16))
            got, want = fused_rope.layer(x, offsets), rope(x, offsets)
            if extension() is not None or length == 1:  # (with the extension, any length)
                assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), (dims, traditional, scale)
            else:  # without it, prefill keeps mlx's own function
                assert mx.array_equal(got, want).item()
        x = mx.random.normal((1, 4, 1, 16))
        assert mx.allclose(fused_rope.layer(x, 9), rope(x, 9), atol=1e-5).item()  # an integer offset too
        assert mx.allclose(fused_rope.layer(x, mx.array(9)), rope(x, 9), atol=1e-5).item()
        half = mx.random.normal((5, 4, 1, 16)).astype(mx.bfloat16)
        got = fused_rope.layer(half, offsets)
        assert got.dtype == mx.bfloat16
        # float32 inside, rounded once; the reference rounds each product: within a unit in the last place
        assert mx.allclose(got, rope(half, offsets), rtol=1e-2, atol=1e-2).item()


def decode(model: Any, prompts: list[list[int]]) -> dict[int, tuple[list[int], list[mx.array]]]:
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=len(prompts), prefill_batch_size=4)
    wanted: set[int] = set()
    install(gen, wanted)
    uids = gen.insert(prompts, max_tokens=[16] * len(prompts))
    wanted.update(uids)
    row = {u: i for i, u in enumerate(uids)}
    out: dict[int, tuple[list[int], list[mx.array]]] = {i: ([], []) for i in range(len(prompts))}
    while responses := gen.next_generated():
        for r in responses:
            out[row[r.uid]][0].append(r.token)
            out[row[r.uid]][1].append(r.logprobs)
    gen.close()
    return out


def test_decoding_gives_the_same_tokens_and_logprobs(random_model_dir: Path) -> None:
    prompts = [[1 + (11 * i + 3 * j) % 900 for j in range(4 + 5 * i)] for i in range(6)]
    plain = decode(load(random_model_dir), prompts)
    model = load(random_model_dir)
    fuse_cpu_kernels(model)
    fused = decode(model, prompts)
    for i in range(len(prompts)):
        assert fused[i][0] == plain[i][0], i
        for a, b in zip(fused[i][1], plain[i][1], strict=True):
            assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item(), i


async def test_engine_answers_alike_with_and_without_fusion(random_model_dir: Path) -> None:
    answers = []
    for fusion in (True, False):
        async with open_engine(random_model_dir, cpu_fusion=fusion) as engine:
            rows = []
            for text in ("the quick brown fox", "local inference streams tokens " * 3):
                c = await engine.complete(ChatRequest.from_openai({
                    "messages": [{"role": "user", "content": text}], "max_tokens": 12,
                    "temperature": 0, "logprobs": True}))
                choice = c["choices"][0]
                rows.append((choice["message"]["content"],
                             [t["logprob"] for t in choice["logprobs"]["content"]]))
            answers.append(rows)
    for (text_a, lps_a), (text_b, lps_b) in zip(*answers, strict=True):
        assert text_a == text_b
        assert lps_a == pytest.approx(lps_b, abs=1e-4)


EXIT_SCRIPT = """
import sys, trio, afm_core

async def main():
    async with afm_core.open_engine(sys.argv[1], max_batch=2) as engine:
        async def one(text):
            await engine.complete(afm_core.ChatRequest.from_openai({
                "messages": [{"role": "user", "content": text}], "max_tokens": 16, "temperature": 0}))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "a b c")
            nursery.start_soon(one, "d e f g h")

trio.run(main)
"""


def test_the_process_exits_cleanly_right_after_the_engine_closes(random_model_dir: Path) -> None:
    # MLX clears a thread's compiled traces when the thread ends, which needs
    # the GIL; with generation threads that ended at engine close, an exit
    # right after close aborted the process in about 2 runs out of 3 (see
    # afm_core._engine.genthread)
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(random_model_dir)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "terminate" not in done.stderr, done.stderr[-2000:]
