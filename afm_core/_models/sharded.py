"""Load one model sharded over the ranks of an ``mx.distributed`` group.

mlx-lm's own ``sharded_load(repo, pipeline_group, tensor_group)`` does this
for a Hugging Face repo (it downloads only a pipeline stage's files); afm's
models are local directories (``resolve_model`` has already converted a
GGUF or fetched the default model), so :func:`load_sharded` does the same
steps on a directory: build the model lazily, shard it, then materialise
only this rank's part of the weights.

``tensor``
    tensor parallelism (``model.shard(group)``, in mlx-lm's llama, qwen2/3,
    mistral, deepseek, ... modules): every layer's attention heads and MLP
    columns are split over the ranks, which add their partial results with
    an ``all_sum`` after each sharded layer.  The heads, the key-value heads
    and the MLP's intermediate size must divide by the group size, and for a
    quantized model each rank's share of a sharded input dimension must be a
    whole number of quantization groups; :func:`check_tensor_parallel` says
    which one does not, before any weight is read (mlx would shard anyway
    and fail at the first forward pass with a shape error).
``pipeline``
    pipeline parallelism (``model.model.pipeline(group)``, in mlx-lm's
    modules built on ``PipelineMixin``: qwen2, qwen3_moe, deepseek v2/v3,
    glm4_moe, ...): each rank holds a run of consecutive layers, rank 0 the
    last ones; activations go from stage to stage with ``send``/``recv`` and
    the last stage's output reaches every rank with an ``all_gather``.

May import: mlx, mlx-lm, :mod:`afm_core._errors`, the rest of ``_models``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._errors import ModelLoadError
from .._mlx.tokenizer import drop_token_map
from .loader import ModelInfo, describe

__all__ = ["MODES", "check_pipeline", "check_tensor_parallel", "load_sharded"]

MODES = ("tensor", "pipeline")


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def check_tensor_parallel(config: dict[str, Any], size: int) -> None:
    """Raise :class:`ModelLoadError` saying why ``config``'s model cannot be
    split over ``size`` ranks by tensor parallelism (nothing when it can)."""
    cfg = _text_config(config)
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    inter = int(cfg.get("intermediate_size") or 0)
    hidden = int(cfg.get("hidden_size") or 0)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    uneven = [f"{n} {what}" for what, n in (("attention heads", heads), ("key-value heads", kv_heads),
                                            ("MLP intermediate size", inter)) if n and n % size]
    if uneven:
        raise ModelLoadError(f"cannot split this model over {size} ranks by tensor parallelism: "
                             f"{' and '.join(uneven)} do not divide by {size}")
    quant = cfg.get("quantization") or cfg.get("quantization_config")
    if isinstance(quant, dict) and quant.get("group_size"):
        group = int(quant["group_size"])
        # the "sharded-to-all" layers (o_proj, down_proj) split their input dimension
        broken = [f"the {what} gets {n // size} inputs per rank" for what, n in
                  (("attention output", heads * head_dim), ("MLP down projection", inter))
                  if n and (n // size) % group]
        if broken:
            raise ModelLoadError(f"cannot split this quantized model over {size} ranks by tensor "
                                 f"parallelism: {' and '.join(broken)}, not a whole number of its "
                                 f"quantization groups of {group}")


def check_pipeline(model: Any, size: int) -> None:
    """Raise :class:`ModelLoadError` when ``model`` cannot be split into
    ``size`` pipeline stages."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "pipeline"):
        kind = type(model).__module__.rsplit(".", 1)[-1]
        raise ModelLoadError(f"mlx-lm's {kind} model does not support pipeline parallelism "
                             "(its module has no PipelineMixin); try --distributed tensor")
    layers = len(getattr(inner, "layers", ()))
    if layers < size:
        raise ModelLoadError(f"cannot split {layers} layers into {size} pipeline stages")


def load_sharded(path: Path, mode: str, group: Any) -> tuple[Any, Any, ModelInfo]:
    """``(model, tokenizer, info)`` with this rank's shard of the model at
    ``path``, split over ``group`` by ``mode`` (``tensor`` or ``pipeline``);
    runs on the generation thread.  Every rank of ``group`` must call it (it
    ends with a collective barrier)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer

    if mode not in MODES:
        raise ModelLoadError(f"unknown distributed mode {mode!r}: use one of {', '.join(MODES)}")
    size = group.size()
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not read {path / 'config.json'}: {exc}") from exc
    if mode == "tensor":
        check_tensor_parallel(config, size)
    try:
        model, config = load_model(path, lazy=True, strict=False)
    except Exception as exc:
        raise ModelLoadError(f"could not load the model at {path}: {exc}") from exc
    if mode == "tensor":
        if not hasattr(model, "shard"):
            kind = type(model).__module__.rsplit(".", 1)[-1]
            raise ModelLoadError(f"mlx-lm's {kind} model does not support tensor parallelism "
                                 "(no shard method); try --distributed pipeline")
        model.shard(group)
    else:
        check_pipeline(model, size)
        model.model.pipeline(group)
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        mx.eval(model.parameters())
    except Exception as exc:
        raise ModelLoadError(f"could not load the model at {path}: {exc}") from exc
    # every rank has its shard before any rank computes (mlx-lm's sharded_load does the same)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    drop_token_map(tokenizer)
    return model, tokenizer, describe(path, tokenizer)
