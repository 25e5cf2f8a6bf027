"""afm_core._mlx.qmm_groups: sibling projections as one product, same bits."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import qmatmul as _qmatmul
from afm_core._mlx import qmm_groups, qmm_layers

needs_ext = pytest.mark.skipif(_qmatmul.extension() is None,
                               reason="afm_core._mlx.qmm_ext is not built or disabled")


def _model(tmp_path, bits=4):
    from mlx_lm.utils import load_model

    from afm_core.testing import make_random_model

    path = make_random_model(tmp_path / "m", hidden_size=128, num_layers=2,
                             intermediate_size=256, seed=7)
    model, _ = load_model(path)
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def _logits(model):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array([[5, 17, 256, 3, 99, 7, 1, 2, 3]]), cache=cache)]
    for token in (42, 7, 300):
        out.append(model(mx.array([[token]]), cache=cache))
    mx.eval(out)
    return [np.array(o) for o in out]


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_products_are_the_same_bits(tmp_path, bits, monkeypatch):
    model = _model(tmp_path, bits)
    monkeypatch.setenv(qmm_groups.NO_GROUPS_ENV, "1")
    qmm_layers.use_fast_qmm(model)  # fast kernels, layers apart
    apart = _logits(model)
    weights = {name: np.array(p) for name, p in
               nn.utils.tree_flatten(model.parameters()) if "proj" in name}
    monkeypatch.delenv(qmm_groups.NO_GROUPS_ENV)
    assert qmm_groups.group_siblings(model) == 2 * 2  # q/k/v and gate/up of 2 layers
    attn = model.model.layers[0].self_attn
    assert type(attn.q_proj).__name__ == "_GroupedQuantizedLinear"
    assert attn.q_proj._group is attn.v_proj._group
    # the layers' own parameters are unchanged in value (views of the family's matrix)
    for name, p in nn.utils.tree_flatten(model.parameters()):
        if "proj" in name:
            assert np.array_equal(np.array(p), weights[name]), name
    grouped = _logits(model)
    for a, b in zip(grouped, apart, strict=True):
        assert np.array_equal(a, b)
    assert qmm_groups.ungroup_siblings(model) == 2 * 5
    assert type(attn.q_proj) is _qmatmul._FastQuantizedLinear
    for a, b in zip(_logits(model), apart, strict=True):
        assert np.array_equal(a, b)


@needs_ext
def test_a_member_called_alone_and_no_activations_held(tmp_path):
    model = _model(tmp_path)
    qmm_layers.use_fast_qmm(model)
    attn = model.model.layers[0].self_attn
    group = attn.q_proj._group
    x = mx.random.normal((1, 3, 128))
    y = mx.random.normal((1, 3, 128))
    q_x = attn.q_proj(x)
    k_y = attn.k_proj(y)  # another input: computed for y, not sliced from x's product
    ref_k = _qmatmul.quantized_matmul(y, attn.k_proj["weight"], attn.k_proj["scales"],
                                      attn.k_proj["biases"], group_size=32, bits=4)
    assert np.array_equal(np.array(k_y), np.array(ref_k))
    assert q_x.shape == (1, 3, 128)
    for layer in (attn.q_proj, attn.k_proj, attn.v_proj):
        layer(y)
    assert group._x is None and group._outs is None  # every member served: nothing held


def test_nothing_groups_without_the_extension(tmp_path, monkeypatch):
    model = _model(tmp_path)
    monkeypatch.setattr(_qmatmul, "_ext", None)
    assert qmm_groups.group_siblings(model) == 0


@needs_ext
def test_a_kv_cache_holds_only_its_own_bytes_after_a_whole_buffer_prefill(tmp_path):
    """A prefill chunk of exactly mlx-lm's allocation step (256 tokens) makes the
    cache's slice assignment keep the value projection's array as it is: it must be
    the member's own array, not a view holding the whole q/k/v product alive."""
    import gc

    from mlx_lm.models.cache import make_prompt_cache

    model = _model(tmp_path)
    qmm_layers.use_fast_qmm(model)  # groups the siblings too
    assert type(model.model.layers[0].self_attn.v_proj).__name__ == "_GroupedQuantizedLinear"
    for length in (256, 250):
        gc.collect()
        before = mx.get_active_memory()
        cache = make_prompt_cache(model)
        model(mx.array([[(7 * i) % 300 + 3 for i in range(length)]]), cache=cache)
        mx.eval([c.state for c in cache])
        gc.collect()
        held = mx.get_active_memory() - before
        own = sum(c.nbytes for c in cache)
        assert own <= held < own * 1.05, (length, held, own)
        del cache


def _qwen2(bits=4):
    """A tiny random Qwen2 (q/k/v projections with biases)."""
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, num_attention_heads=4, rms_norm_eps=1e-6,
                           vocab_size=512, num_key_value_heads=2, rope_theta=10000.0,
                           tie_word_embeddings=True)
    mx.random.seed(11)
    model = qwen2.Model(args)
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def _ops(model):
    import collections
    import re
    import tempfile

    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5, 17, 256, 3]]), cache=cache))
    y = model(mx.array([[7]]), cache=cache)
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, y)
        return collections.Counter(re.findall(r'label ?= ?"([A-Za-z][^"]*)", shape=rectangle',
                                              f.read()))


@needs_ext
@pytest.mark.parametrize("bits", [4, 6])
def test_biases_added_by_the_grouped_product(bits, monkeypatch):
    """Qwen2's q/k/v biases are added by the family's one operation: the same
    bits as the layers apart (each adding its own), close to mlx-lm's own
    layers, and three additions and the columns' slices fewer per layer."""
    model = _qwen2(bits)
    ref = _logits(model)
    plain = _ops(model)
    monkeypatch.setenv(qmm_groups.NO_GROUPS_ENV, "1")
    qmm_layers.use_fast_qmm(model)
    apart = _logits(model)
    monkeypatch.delenv(qmm_groups.NO_GROUPS_ENV)
    assert qmm_groups.group_siblings(model) == 2 * 2
    grouped = _logits(model)
    for a, b, r in zip(grouped, apart, ref, strict=True):
        assert np.array_equal(a, b)
        assert np.abs(a - r).max() <= 1e-3 * np.abs(r).max()
    ops = _ops(model)
    assert ops["Add"] == plain["Add"] - 3 * 2
    assert ops["Slice"] <= plain["Slice"]
    assert ops["AfmQuantizedMatmul"] == 2 * 4 + 1  # q/k/v, o, gate/up, down; the head


def _quantized_pair(rows, cols, bits, scale_dtype=mx.float32, seed=3):
    """A gate/up family's concatenated weight (``rows`` of each half) as the kernels take it."""
    mx.random.seed(seed)
    wq, scales, biases = mx.quantize(mx.random.normal((2 * rows, cols)) * 0.2, 32, bits)
    return wq, scales.astype(scale_dtype), biases.astype(scale_dtype)


@needs_ext
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("rows", [1, 5, 40, 64, 1100])
def test_the_swiglu_epilogue_is_the_bits_of_swiglu_on_the_two_outputs(bits, rows):
    """Decode-sized inputs (the integer kernels), prompt-sized ones (sgemm,
    1,100 rows: the columns in several pieces) and float16 scales."""
    ext = _qmatmul.extension()
    for scale_dtype in (mx.float32, mx.float16):
        wq, scales, biases = _quantized_pair(1024, 128, bits, scale_dtype)
        x = mx.random.normal((rows, 128))
        gate, up = ext.quantized_matmul_split(x, wq, scales, biases, 32, bits, [1024, 1024])
        fused = ext.quantized_matmul_swiglu(x, wq, scales, biases, 32, bits)
        assert fused.shape == (rows, 1024)
        assert np.array_equal(np.array(fused), np.array(ext.swiglu(gate, up)))
        # leading axes and a strided input, as a model's (B, L, K) activations
        x3 = mx.random.normal((2, 128, rows)).transpose(0, 2, 1)
        gate, up = ext.quantized_matmul_split(x3, wq, scales, biases, 32, bits, [1024, 1024])
        fused = ext.quantized_matmul_swiglu(x3, wq, scales, biases, 32, bits)
        assert fused.shape == (2, rows, 1024)
        assert np.array_equal(np.array(fused), np.array(ext.swiglu(gate, up)))


@needs_ext
def test_the_swiglu_epilogue_refuses_what_it_cannot_compute():
    ext = _qmatmul.extension()
    wq, scales, biases = _quantized_pair(64, 128, 4)
    with pytest.raises(ValueError, match="x must be float32"):
        ext.quantized_matmul_swiglu(mx.zeros((2, 128), mx.float16), wq, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="even number of rows"):
        ext.quantized_matmul_swiglu(mx.zeros((2, 128)), wq[:127], scales[:127], biases[:127],
                                    32, 4)
    with pytest.raises(ValueError, match="last dimension"):
        ext.quantized_matmul_swiglu(mx.zeros((2, 64)), wq, scales, biases, 32, 4)


def _fused_model(tmp_path, monkeypatch, fused):
    from afm_core._mlx.fusion import fuse_cpu_kernels

    if not fused:
        monkeypatch.setenv(qmm_groups.NO_SWIGLU_ENV, "1")
    model = _model(tmp_path)
    fuse_cpu_kernels(model)
    monkeypatch.delenv(qmm_groups.NO_SWIGLU_ENV, raising=False)
    return model


def _long_logits(model):
    """A prompt past the rows from which products go through sgemm, then decode steps."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array([[(7 * i) % 500 + 3 for i in range(90)]]), cache=cache)]
    for token in (42, 7, 300):
        out.append(model(mx.array([[token]]), cache=cache))
    mx.eval(out)
    return [np.array(o) for o in out]


@needs_ext
def test_a_swiglu_mlp_takes_the_epilogue_with_the_same_logits(tmp_path, monkeypatch):
    """mlx-lm's MLP (``down(swiglu(gate(x), up(x)))``) on the fused kernels:
    one product per MLP instead of a product and a SwiGLU, the logits the same
    bits as with the two operations."""
    from afm_core._mlx.fusion import unfuse_cpu_kernels

    apart = _fused_model(tmp_path, monkeypatch, fused=False)
    model = _fused_model(tmp_path, monkeypatch, fused=True)
    for a, b in zip(_long_logits(model), _long_logits(apart), strict=True):
        assert np.array_equal(a, b)
    ops, ops_apart = _ops(model), _ops(apart)
    assert ops["AfmQuantizedSwiglu"] == 2 and "AfmSwiglu" not in ops  # one per layer
    assert ops_apart["AfmSwiglu"] == 2 and "AfmQuantizedSwiglu" not in ops_apart
    # (and at decode the MLP's norm goes into the fused product's prologue,
    # afm_core._mlx.decode_layout: one more per layer)
    assert sum(ops.values()) == sum(ops_apart.values()) - 4
    assert ops_apart["AfmRMSNorm"] - ops["AfmRMSNorm"] == 2
    unfuse_cpu_kernels(model)  # mlx-lm's functions back: the epilogue with them
    assert "AfmQuantizedSwiglu" not in _ops(model)


@needs_ext
def test_the_epilogue_only_for_the_familys_own_outputs_and_nothing_held(tmp_path, monkeypatch):
    import gc
    import weakref

    from afm_core._mlx.activations import swiglu

    model = _fused_model(tmp_path, monkeypatch, fused=True)
    mlp = model.model.layers[0].mlp
    x = mx.random.normal((1, 3, 128))
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    other = up + 0  # not the family's output: the SwiGLU of the arrays given
    assert qmm_groups.fused_swiglu(gate, other) is None
    ref = np.array(swiglu(gate, other))
    fused = swiglu(gate, up)
    assert np.array_equal(np.array(fused), ref)  # up + 0 is up's bits
    assert qmm_groups.fused_swiglu(gate, up) is None  # taken once: the pair is spent
    # what the family served last is only weakly referenced
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    probe = weakref.ref(x)
    del gate, up, x, other, fused
    gc.collect()
    assert probe() is None
