"""afm_core._mlx.lora: adapters on top of the CPU rewrite (quantized, grouped
q/k/v and gate/up layers), equal to mlx-lm's LoRALinear; rows on different
adapters in one forward each equal to their own adapter's model, and
independent of the rows beside them.

Tolerances.  The CPU rewrite's quantized products round each block of 32
activations to a 16-bit grid (an int8 value plus an int8 remainder:
``|x - x_hat| <= amax / (4 * 127**2)``, about 1.6e-5 of the block's largest
value; ``afm_core._mlx.qmatmul``), where mlx-lm's own product keeps float32
activations.  Carried through this 2-layer model, that rounding moves the
logits by 1-2e-4 of the largest one on every kernel set (scalar, avx2,
avx2-vnni, avx512-vnni; OpenBLAS's Haswell and SkylakeX kernels).
``KERNEL_RTOL`` is ten times that and twenty-five times below what an adapter
changes (more than 5%, asserted), so it tells the right adapter from a wrong
one on any CPU.

Two paths of the rewrite itself are never compared at float-rounding
precision: a forward whose rows share one adapter uses ``addmm`` and a mixed
one ``gather_mm``, which round differently, and the next layer's activation
rounding can turn a last-bit difference into one grid step (4e-4 of the
largest logit on AVX2).  So mixed rows are compared with mlx-lm's reference
for their own adapter (within ``KERNEL_RTOL``), and with themselves beside
other neighbours, where the arithmetic is the same and the result must be
bit for bit the same.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import lora
from afm_core._mlx import qmatmul as _qmatmul
from afm_core._mlx.fusion import fuse_cpu_kernels, unfuse_cpu_kernels
from afm_core.testing import make_lora_adapter, make_random_model

ALL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPT = [5, 17, 256, 3, 99, 7, 1, 2, 3]
KERNEL_RTOL = 2e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = make_random_model(root / "m", hidden_size=128, num_layers=2, intermediate_size=256, seed=7)
    a1 = make_lora_adapter(model, root / "a1", keys=ALL, rank=8, random=True, seed=1)
    a2 = make_lora_adapter(model, root / "a2", keys=("self_attn.q_proj", "self_attn.v_proj"), rank=4,
                           random=True, seed=2)
    return model, a1, a2


def _quantized(path: Path) -> nn.Module:
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def _logits(model: nn.Module, rows: lora.AdapterRows | None = None, uid: int = 0) -> np.ndarray:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = []
    for ids in (PROMPT, [42], [7]):
        if rows is not None:
            rows.select_rows([uid])
        out.append(model(mx.array([ids]), cache=cache)[:, -1])
        if rows is not None:
            rows.clear()
    mx.eval(out)
    return np.concatenate([np.array(o) for o in out])


@pytest.mark.parametrize("which", [1, 2])
def test_adapters_over_the_cpu_rewrite_equal_mlx_lm(setup: tuple[Path, Path, Path], which: int) -> None:
    from mlx_lm.tuner.utils import load_adapters

    path, a1, a2 = setup
    adapter = (a1, a2)[which - 1]
    reference = _quantized(path)
    load_adapters(reference, str(adapter))
    want = _logits(reference)
    base = _logits(_quantized(path))

    model = _quantized(path)
    fuse_cpu_kernels(model)
    rows = lora.attach_adapters(model, [("a1", a1), ("a2", a2)])
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, lora.AdaptedLinear)
    if _qmatmul.extension() is not None:
        assert type(attn.q_proj.linear).__name__ == "_GroupedQuantizedLinear"  # still one q/k/v product
    rows.of[0] = which
    got = _logits(model, rows)
    assert np.abs(got - want).max() < KERNEL_RTOL * np.abs(want).max()
    assert np.abs(want - base).max() > 0.05 * np.abs(want).max()  # the adapter matters
    rows.of.clear()
    assert np.abs(_logits(model, rows) - base).max() < KERNEL_RTOL * np.abs(base).max()
    assert lora.detach_adapters(model) == 2 * 7
    unfuse_cpu_kernels(model)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear


def _reference_row(path: Path, adapter: Path | None, token: int) -> np.ndarray:
    """One row's logits through mlx-lm's own model (MLX's quantized product,
    ``LoRALinear`` for ``adapter``), alone."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tuner.utils import load_adapters

    model = _quantized(path)
    if adapter is not None:
        load_adapters(model, str(adapter))
    out = model(mx.array([[token]]), cache=make_prompt_cache(model))
    mx.eval(out)
    return np.array(out[0])


def test_rows_on_different_adapters_in_one_forward(setup: tuple[Path, Path, Path]) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    path, a1, a2 = setup
    model = _quantized(path)
    fuse_cpu_kernels(model)
    rows = lora.attach_adapters(model, [("a1", a1), ("a2", a2)])
    rows.of.update({10: 1, 12: 2, 13: 1})  # uid 11: no adapter
    token = {10: 3, 11: 9, 12: 27, 13: 5}
    adapter = {10: a1, 11: None, 12: a2, 13: a1}

    def forward(uids: list[int]) -> dict[int, np.ndarray]:
        rows.select_rows(uids)
        assert isinstance(rows.current, mx.array)  # the mixed path
        out = model(mx.array([[token[u]] for u in uids]), cache=make_prompt_cache(model))
        rows.clear()
        mx.eval(out)
        return {u: np.array(out[i]) for i, u in enumerate(uids)}

    batches = [forward(b) for b in ([10, 11, 12], [12, 10], [11, 12, 13, 10], [10, 13, 12], [13, 11])]
    for uid in token:
        seen = [b[uid] for b in batches if uid in b]
        assert len(seen) >= 2
        for other in seen[1:]:  # the same arithmetic whatever the neighbours: the same bits
            np.testing.assert_array_equal(other, seen[0], err_msg=f"uid {uid}")
        want = _reference_row(path, adapter[uid], token[uid])
        assert np.abs(seen[0] - want).max() < KERNEL_RTOL * np.abs(want).max(), uid
        if adapter[uid] is not None:  # the adapter matters: a wrong one would fail the bound above
            base = _reference_row(path, None, token[uid])
            assert np.abs(want - base).max() > 0.05 * np.abs(want).max(), uid
    lora.detach_adapters(model)
    unfuse_cpu_kernels(model)


def test_unfit_adapters_are_refused(setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    a1 = setup[1]
    other = make_random_model(tmp_path / "small", hidden_size=64, num_layers=2, seed=3)
    from mlx_lm.utils import load_model

    model, _ = load_model(other)
    with pytest.raises(ValueError, match="the model's layer"):
        lora.attach_adapters(model, [("a1", a1)])
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text('{"fine_tune_type": "dora"}')
    (tmp_path / "dora" / "adapters.safetensors").write_bytes((a1 / "adapters.safetensors").read_bytes())
    with pytest.raises(ValueError, match="only 'lora'"):
        lora.read_adapter(tmp_path / "dora")
