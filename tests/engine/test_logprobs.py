"""The log-probability records (``afm_core._engine.logprobs``) and the
model-size estimates (``afm_core._engine.kv_memory``), on the random tiny
model from ``afm_core.testing`` with real MLX arrays."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from afm_core._engine.kv_memory import (
    PREFIX_CACHE_CAP,
    context_length,
    default_prefix_budget,
    kv_bytes_per_token,
    param_bytes,
    vocab_size,
)
from afm_core._engine.logprobs import prompt_logprobs, token_logprobs
from afm_core._mlx.prefill import PromptScores


@pytest.fixture(scope="module")
def loaded(random_model_dir: Path) -> tuple[Any, Any]:
    model, tokenizer = load(str(random_model_dir))[:2]
    return model, tokenizer


def test_a_token_s_record_names_it_and_its_likeliest_rivals(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    ids = tok.encode("hello world")
    logits = model(mx.array(ids)[None])[0, -1]
    logprobs = logits - mx.logsumexp(logits)
    best = int(mx.argmax(logprobs).item())
    delta = token_logprobs(tok, best, logprobs, 3)
    [entry] = delta.content
    assert entry.token == tok.decode([best]) and entry.bytes == tuple(entry.token.encode("utf-8"))
    assert math.isclose(entry.logprob, float(logprobs[best].item()), rel_tol=1e-6)
    assert len(entry.top_logprobs) == 3
    assert entry.top_logprobs[0].token == entry.token  # the sampled token was the likeliest
    values = [t.logprob for t in entry.top_logprobs]
    assert values == sorted(values, reverse=True)
    assert token_logprobs(tok, best, logprobs, 0).content[0].top_logprobs == ()


def test_a_scored_prompt_s_record(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    prompt = tok.encode("the quick brown fox")
    assert len(prompt) >= 3
    scores = PromptScores(prompt, top_k=2)
    scores.score(model, prompt, make_prompt_cache(model), 0)
    assert scores.error is None
    record = prompt_logprobs(tok, prompt, scores)
    assert record.ids == tuple(prompt)
    assert record.tokens == tuple(tok.decode([i]) for i in prompt)
    assert record.logprobs[0] is None and len(record.logprobs) == len(prompt)
    assert all(lp is not None and lp <= 0 for lp in record.logprobs[1:])
    assert record.top_logprobs[0] == () and all(len(t) == 2 for t in record.top_logprobs[1:])
    # a count that does not match the prompt is an error, not a short record
    scores.logprobs.pop()
    with pytest.raises(RuntimeError, match="scored"):
        prompt_logprobs(tok, prompt, scores)


def test_the_sizes_come_from_the_model_s_config(loaded: tuple[Any, Any]) -> None:
    model, _ = loaded
    args = model.args
    assert vocab_size(model) == args.vocab_size
    assert context_length(model) == args.max_position_embeddings > 0
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    per_f32 = 2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * 4
    assert kv_bytes_per_token(model) == per_f32
    assert kv_bytes_per_token(model, half=True) == per_f32 // 2
    q8 = kv_bytes_per_token(model, kv_bits=8, group_size=64)
    assert per_f32 // 4 < q8 < per_f32 // 2  # a byte per element plus the groups' scales
    assert default_prefix_budget(model, None, 64, False) == min(PREFIX_CACHE_CAP,
                                                                per_f32 * context_length(model))
    assert param_bytes(model) == sum(v.nbytes for _, v in _flat(model.parameters()))


def test_a_model_without_a_config_gets_the_cap() -> None:
    class Bare:
        pass

    bare: Any = Bare()
    assert kv_bytes_per_token(bare) == 0 and context_length(bare) == 0
    assert vocab_size(bare) == 1 << 30
    assert default_prefix_budget(bare, None, 64, False) == PREFIX_CACHE_CAP


def _flat(tree: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    return tree_flatten(tree)  # type: ignore[return-value]
