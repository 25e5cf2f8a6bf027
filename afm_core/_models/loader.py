"""Load a model and describe what its tokenizer and template can do."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import ModelLoadError
from .._mlx.tokenizer import drop_token_map, hf_tokenizer
from .templates import template_features


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Static facts about the loaded model."""

    id: str
    path: Path
    context_length: int
    vocab_size: int
    think_tags: tuple[str, str] | None
    tool_format: str | None
    chat_template: str
    #: the template reads ``tools``; when False afm renders them itself
    #: (:mod:`afm_core._models.templates`) and parses Hermes-style calls
    template_tools: bool = True


def load(path: Path) -> tuple[Any, Any, ModelInfo]:
    """``(model, tokenizer, info)``; runs on the generation thread.  A GGUF
    conversion's K-quant blocks (:data:`~.gguf.convert.KQUANT_FILE`) replace
    the MLX layout of their layers where afm's CPU kernels run
    (:mod:`afm_core._mlx.kquant`), before anything is read."""
    import mlx.core as mx
    import mlx_lm

    from .._mlx.kquant import kquant_wanted, use_kquant_blocks
    from .gguf.convert import KQUANT_FILE

    blocks = Path(path) / KQUANT_FILE
    lazy = blocks.is_file() and kquant_wanted()
    try:
        # mlx-lm annotates a 2- or 3-tuple; without return_config it is always 2
        model, tokenizer = mlx_lm.load(str(path), lazy=lazy)  # type: ignore[misc]
        if lazy:
            use_kquant_blocks(model, blocks)
            mx.eval(model.parameters())
    except Exception as exc:  # any failure surfaces as a typed error
        raise ModelLoadError(f"could not load the model at {path}: {exc}") from exc
    drop_token_map(tokenizer)
    return model, tokenizer, describe(path, tokenizer)


def describe(path: Path, tokenizer: Any) -> ModelInfo:
    config = json.loads((path / "config.json").read_text())
    hf = hf_tokenizer(tokenizer)
    template = _default_template(getattr(hf, "chat_template", None))
    ctx = int(
        config.get("max_position_embeddings")
        or (config.get("text_config") or {}).get("max_position_embeddings")
        or getattr(hf, "model_max_length", 0)
        or 4096
    )
    vocab = hf.get_vocab() if hasattr(hf, "get_vocab") else {}
    think = ("<think>", "</think>") if "<think>" in vocab and "</think>" in vocab else None
    tool_format, native = tool_format_for(template, vocab)
    return ModelInfo(
        id=path.name,
        path=path,
        context_length=ctx,
        vocab_size=int(config.get("vocab_size") or len(vocab)),
        think_tags=think,
        tool_format=tool_format,
        chat_template=template,
        template_tools=native,
    )


def _default_template(template: Any) -> str:
    """The template text; of named templates, ``tool_use`` if there (it is the
    one that renders tools), else ``default``."""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or next(iter(template.values()), "")
    return template if isinstance(template, str) else ""


def tool_format_for(template: str, vocab: Iterable[str]) -> tuple[str | None, bool]:
    """``(tool-call format, the template renders tools itself)``.

    A template that reads ``tools`` is trusted with them and its format is
    guessed from its markers (and the vocabulary's); one that does not gets
    afm's Hermes-style tool prompt, so its calls parse as ``hermes``.  No
    template (a base model): no format (chat is refused).
    """
    if not template:
        return None, False
    if template_features(template).tools:
        return guess_tool_format(template, vocab), True
    return "hermes", False


def guess_tool_format(template: str, vocab: Iterable[str]) -> str | None:
    """The tool-call wire format the model was trained on, from its template."""
    from .._stream.toolcalls.registry import guess_tool_format as guess

    return guess(template, vocab)
