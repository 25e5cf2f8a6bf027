"""LoRA adapters for test models, written with mlx-lm's own tuner (mlx-lm's adapter format)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["make_lora_adapter"]

DEFAULT_TEXT = ("The quick brown fox jumps over the lazy dog. " * 4,
                "Adapters change what a model says next: tea, then cake, then tea. " * 3)


def make_lora_adapter(
    model_dir: str | Path,
    out: str | Path,
    *,
    keys: Sequence[str] = ("self_attn.q_proj", "self_attn.v_proj"),
    rank: int = 8,
    scale: float = 20.0,
    iters: int = 20,
    learning_rate: float = 1e-2,
    texts: Sequence[str] = DEFAULT_TEXT,
    random: bool = False,
    seed: int = 0,
) -> Path:
    """Write an mlx-lm adapter directory for the model at ``model_dir`` to ``out``.

    ``linear_to_lora_layers`` (mlx-lm's tuner) adds LoRA layers of ``rank``
    and ``scale`` on the ``keys`` projections of every layer; then ``iters``
    steps of Adam on mlx-lm's ``default_loss`` over ``texts`` (as
    ``mlx_lm.lora`` trains), or with ``random`` no training: ``lora_b``
    drawn at random too (a benchmark's adapter of a given size).  The files
    are what ``mlx_lm.lora`` writes: ``adapter_config.json`` and
    ``adapters.safetensors`` (the trainable parameters).
    """
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.lora import LoRALinear
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from .._mlx.reference_ops import mlx_lm_operations

    mx.random.seed(seed)
    model, tokenizer = mlx_lm.load(str(model_dir))[:2]
    model.freeze()
    num_layers = len(model.layers)
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}
    linear_to_lora_layers(model, num_layers, params)
    if random:
        for _, layer in model.named_modules():
            if isinstance(layer, LoRALinear):
                r, n = layer.lora_b.shape
                layer.lora_b = mx.random.normal((r, n)) * (1.0 / (r * scale))
    else:
        rows = [tokenizer.encode(t) for t in texts]
        width = min(len(r) for r in rows)
        batch = mx.array([r[:width] for r in rows])
        lengths = mx.array([[0, width - 1]] * len(rows))
        opt = optim.Adam(learning_rate=learning_rate)
        step = nn.value_and_grad(model, lambda m, b, ln: default_loss(m, b, ln)[0])
        model.train()
        with mlx_lm_operations():  # (a model served in this process may have rebound them to kernels)
            for _ in range(iters):
                _, grads = step(model, batch, lengths)
                opt.update(model, grads)
                mx.eval(model.trainable_parameters(), opt.state)
        model.eval()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
