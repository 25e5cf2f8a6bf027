"""Write complete, offline mlx-lm model directories for tests and benchmarks.

* ``make_random_model``: a qwen3-architecture model with random float32
  weights and the trained byte-level BPE tokenizer.
* ``make_echo_model``: the same tokenizer with the ``afm_echo`` architecture
  (see ``_echo.py``), whose completion is the last user message verbatim.

Both directories load with ``mlx_lm.load`` once ``afm_core`` is imported
(importing it registers the ``afm_echo`` model type with mlx-lm).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._tokenizer import EOS_TOKEN, train_tokenizer, write_tokenizer


def _common(out: Path, vocab_size: int, context_length: int) -> tuple[Any, dict[str, int], int]:
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    ids = write_tokenizer(tok, out, model_max_length=context_length)
    # The embedding may be larger than the learned vocabulary, as in real models.
    model_vocab = max(vocab_size, tok.get_vocab_size())
    eos = ids[EOS_TOKEN]
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"]}, indent=2)
    )
    return tok, ids, model_vocab


def make_random_model(
    out: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    context_length: int = 4096,
    seed: int = 0,
    visible_text: bool = False,
) -> Path:
    """Write a random-weight qwen3 model to ``out`` and return the path.

    Greedy decoding of a random model soon repeats one token, usually a
    newline.  With ``visible_text`` the embedding and an untied output head
    are set so that each printable token mostly predicts its successor on a
    fixed, seeded cycle of printable tokens (the layers' random weights bend
    it into short loops): streams then carry visible text, as a real model's
    do, which is what a benchmark of the serving path should detokenize,
    frame and send."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    out = Path(out)
    tok, ids, model_vocab = _common(out, vocab_size, context_length)
    if hidden_size % num_heads:
        raise ValueError("hidden_size must be a multiple of num_heads")
    config: dict[str, Any] = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": model_vocab,
        "max_position_embeddings": context_length,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": not visible_text,
        "torch_dtype": "float32",
        "eos_token_id": ids[EOS_TOKEN],
        "bos_token_id": None,
    }
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    if visible_text:
        _walk_printable(model, tok, model_vocab, hidden_size, seed)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _printable(text: str) -> bool:
    """Visible text that no parser reads as markup (no tag brackets, no
    replacement character from a partial UTF-8 sequence)."""
    return (bool(text.strip()) and text.isprintable() and "\ufffd" not in text
            and "<" not in text and ">" not in text)


def _walk_printable(model: Any, tok: Any, vocab: int, hidden: int, seed: int) -> None:
    """Unit-length random embeddings (scaled to dominate the layers'
    contributions) and an output head whose row for token ``s`` points at the
    embedding of the token before ``s`` on a seeded cycle of printable tokens;
    every other token predicts a cycle token too, spread over the cycle (so
    that no head row sums many embeddings and wins everywhere)."""
    import random

    import mlx.core as mx
    import numpy as np

    cycle = [t for t in range(tok.get_vocab_size())
             if _printable(tok.decode([t], skip_special_tokens=False))]
    random.Random(seed).shuffle(cycle)
    succ = np.asarray(cycle, dtype=np.int64)[np.arange(vocab) % len(cycle)]
    succ[cycle] = np.roll(cycle, -1)
    emb = np.random.default_rng(seed).standard_normal((vocab, hidden)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    head = np.zeros((vocab, hidden), dtype=np.float32)
    np.add.at(head, succ, emb * 10.0)
    model.model.embed_tokens.weight = mx.array(emb * 4.0)
    model.lm_head.weight = mx.array(head)


def _newline_fused(tok: Any) -> dict[str, list[int]]:
    """Tokens starting with a newline plus more text -> ids of that text."""
    fused: dict[str, list[int]] = {}
    for tid in range(tok.get_vocab_size()):
        text = tok.decode([tid], skip_special_tokens=False)
        if len(text) > 1 and text.startswith("\n"):
            fused[str(tid)] = list(tok.encode(text[1:], add_special_tokens=False).ids)
    return fused


def make_echo_model(out: str | Path, *, context_length: int = 32768, all_positions: bool = False) -> Path:
    """Write the echo model to ``out`` and return the path; with
    ``all_positions`` it returns the logits of every input position (as a
    transformer does: what speculative decoding verifies with), else of the
    last one only."""
    import mlx.core as mx

    out = Path(out)
    tok, ids, model_vocab = _common(out, 1024, context_length)

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False).ids)

    config = {
        "model_type": "afm_echo",
        "vocab_size": model_vocab,
        "max_position_embeddings": context_length,
        "eos_token_id": ids[EOS_TOKEN],
        "end_token_id": ids[EOS_TOKEN],
        "user_header_ids": enc("<|im_start|>user"),
        "newline_ids": enc("\n"),
        "assistant_header_ids": enc("<|im_start|>assistant\n"),
        "think_skip_ids": enc("<think>\n\n</think>\n\n"),
        "newline_fused": _newline_fused(tok),
        "torch_dtype": "float32",
        "all_positions": all_positions,
    }
    mx.save_safetensors(
        str(out / "model.safetensors"),
        {"scale": mx.array([30.0], dtype=mx.float32)},
        metadata={"format": "mlx"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
