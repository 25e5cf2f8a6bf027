"""A GGUF's Q4_K and Q6_K linear layers computed on their blocks as they are.

The conversion writes those blocks beside the model (``kquant.safetensors``),
afm's loader gives them to the layers on the CPU (``afm_core._mlx.kquant``),
and the model's logits stay those of llama.cpp's values (a numpy forward of
the dequantized tensors, ``numpy_ref.py``) within the int8 activations'
rounding.  mlx-lm, ``AFM_NO_KQUANT=1`` and layers the file does not fit keep
the MLX layout."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import load_file

from afm_core._mlx import qmatmul
from afm_core._mlx.kquant import kquant_wanted
from afm_core._models.gguf.arch import get_architecture
from afm_core._models.gguf.convert import KQUANT_FILE, convert_gguf
from afm_core._models.loader import load

from . import numpy_ref
from .test_gguf_archs import IDS, Model, build

pytestmark = pytest.mark.skipif(
    not kquant_wanted(), reason="no K-quant kernel here (afm_core._mlx.qmm_ext not built, AFM_NO_QMM, "
    "AFM_NO_KQUANT, or the NEON kernels, which have none yet)")

# the matrices cycle over these: K-quant layers beside MLX-layout ones
TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q8_0")


def _model(tmp_path: Path, arch: str = "qwen2") -> tuple[Path, Model, dict]:
    built, hp = build(arch)
    m = Model(arch, np.random.default_rng(7), types=TYPES)
    m.meta = built.meta
    for name, _, type_name in built.tensors:
        shape = built.values[name].shape
        if name.endswith(("attn_q.weight", "attn_k.weight")):  # (permuted rows in llama: K-quant here)
            type_name = "Q4_K" if "attn_q" in name else "Q6_K"
        elif len(shape) == 2 and name != "token_embd.weight":
            type_name = None
        m.add(name, shape, type_name)
    return m.write(tmp_path / f"{arch}.gguf"), m, hp


def _kquant_layers(model: nn.Module) -> dict[str, int]:
    return {name: int(layer.bits) for name, layer in model.named_modules() if qmatmul.is_kquant(layer)}


def test_the_blocks_are_written_as_they_are(tmp_path: Path) -> None:
    src, m, _ = _model(tmp_path)
    out = convert_gguf(src, tmp_path / "out")
    blocks = load_file(str(out / KQUANT_FILE))
    with open(out / KQUANT_FILE, "rb") as f:  # safetensors' header: 8-byte length, then JSON
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    types = {k: v for k, v in header["__metadata__"].items() if k != "format"}
    arch = get_architecture("qwen2", src)
    expected = {}
    for name, data, type_name in m.tensors:
        module = (arch.map_name(name) or "").removesuffix(".weight")
        if type_name in ("Q4_K", "Q6_K") and not module.endswith("embed_tokens"):
            assert arch.row_order(f"{module}.weight", {}) is None  # (qwen2 keeps GGUF's row order)
            expected[module] = (type_name, np.asarray(data).reshape(data.shape[0], -1))
    assert types == {module: t for module, (t, _) in expected.items()}
    assert set(types.values()) == {"Q4_K", "Q6_K"} and "lm_head" in types
    for module, (_, data) in expected.items():
        np.testing.assert_array_equal(blocks[f"{module}.weight"], data)
    # mlx-lm reads the model as before: the MLX layout of every layer
    from mlx_lm.utils import load_model

    plain, _ = load_model(out)
    assert not _kquant_layers(plain)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "phi3"])
def test_each_layer_gives_its_mlx_layouts_products(tmp_path: Path, arch: str) -> None:
    """Layer by layer against the same layer as mlx-lm loads it (the MLX
    layout, the same values): rows in the model's order (llama's q and k are
    permuted from the file's), within the int8 activations' rounding."""
    from mlx_lm.utils import load_model

    src, _, _ = _model(tmp_path, arch)
    out = convert_gguf(src, tmp_path / "out")
    model, _, _ = load(out)
    plain, _ = load_model(out)
    mlx_layers = dict(plain.named_modules())
    checked = 0
    for name, layer in model.named_modules():
        if not qmatmul.is_kquant(layer):
            continue
        ref = mlx_layers[name]
        x = mx.random.normal((3, qmatmul.input_dims(layer)), key=mx.random.key(checked))
        want = np.array(ref(x))
        np.testing.assert_allclose(np.array(layer(x)), want, rtol=0, atol=0.02 * np.abs(want).max(), err_msg=name)
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "gemma3", "phi3"])
def test_the_loader_computes_on_the_blocks(tmp_path: Path, arch: str) -> None:
    """Row orders (llama's q/k), fused projections (phi3's qkv), tied heads."""
    src, m, hp = _model(tmp_path, arch)
    out = convert_gguf(src, tmp_path / "out")
    model, _, _ = load(out)
    layers = _kquant_layers(model)
    assert set(layers.values()) == {4, 6}
    expected = numpy_ref.forward(arch, hp, m.values, IDS)
    got = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    # int8 activations per 256 values (about 1% of the largest output,
    # tests/mlx/test_qmm_kquant.py bounds a product exactly)
    np.testing.assert_allclose(got, expected, rtol=0, atol=0.03 * np.abs(expected).max())

    from afm_core._mlx.fusion import fuse_for_cpu, unfuse_cpu_kernels

    fuse_for_cpu(model)  # grouped with siblings of the same type, epilogues and all
    fused = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    np.testing.assert_allclose(fused, expected, rtol=0, atol=0.03 * np.abs(expected).max())
    unfuse_cpu_kernels(model)  # the blocks stay: there is no MLX layer to go back to
    assert _kquant_layers(model) == layers
    again = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    np.testing.assert_allclose(again, got, rtol=0, atol=1e-5 * np.abs(got).max())


def test_no_kquant_keeps_the_mlx_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _, _ = _model(tmp_path)
    out = convert_gguf(src, tmp_path / "out")
    monkeypatch.setenv("AFM_NO_KQUANT", "1")
    model, _, _ = load(out)
    assert not _kquant_layers(model)


def test_blocks_that_do_not_fit_keep_the_mlx_layout(tmp_path: Path) -> None:
    """A damaged or foreign file never breaks the load: its layers keep the MLX layout."""
    src, _, _ = _model(tmp_path)
    out = convert_gguf(src, tmp_path / "out")
    blocks = load_file(str(out / KQUANT_FILE))
    first = sorted(blocks)[0]
    with open(out / KQUANT_FILE, "rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    short = {k: mx.array(v) for k, v in blocks.items()}
    short[first] = short[first][:, :-1]  # not whole blocks
    mx.save_safetensors(str(out / KQUANT_FILE), short, metadata=meta)
    model, _, _ = load(out)
    layers = _kquant_layers(model)
    assert first.removesuffix(".weight") not in layers and len(layers) == len(blocks) - 1
    (out / KQUANT_FILE).write_bytes(b"not a safetensors file")
    model, _, _ = load(out)
    assert not _kquant_layers(model)


def test_dequantized_conversions_write_no_blocks(tmp_path: Path) -> None:
    src, _, _ = _model(tmp_path)
    out = convert_gguf(src, tmp_path / "out", dequantize=True)
    assert not (out / KQUANT_FILE).exists()
