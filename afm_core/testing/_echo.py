"""The echo model: an mlx-lm architecture (``model_type: "afm_echo"``) whose
completion is, token for token, the last user message, then end-of-sequence.

It is a real ``nn.Module`` driven like any other model: its single layer's KV
cache stores the token ids it has seen (as keys), so prefill, continuous
batching, cache merging/filtering, prefix-cache trimming and the sampler all
run exactly as for a transformer.  Each forward pass reads the ids back from
the cache, finds the last user turn and the start of the assistant turn, and
puts a large logit on the token to copy next (``scale`` from the weights).

The chat-structure markers are token id sequences stored in ``config.json``
by the factory (``afm_core.testing.make_echo_model``), so the module holds no
tokenizer.  Token id 0 (``<|endoftext|>``, the padding id) is never echoed.
Only the last position's logits are returned (shape ``[B, 1, V]``), which is
all mlx-lm's generators read, unless ``all_positions`` (in ``config.json``)
asks for every input position's (``[B, L, V]``, as a transformer's: what
speculative decoding verifies with).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    eos_token_id: int
    end_token_id: int
    user_header_ids: list[int]
    assistant_header_ids: list[int]
    newline_ids: list[int] = field(default_factory=list)
    think_skip_ids: list[int] = field(default_factory=list)
    # tokens that fuse the header's newline with the first characters of the
    # message ("\n  " before "  indented") -> the ids of those characters
    newline_fused: dict[str, list[int]] = field(default_factory=dict)
    max_position_embeddings: int = 32768
    all_positions: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in params.items() if k in names})


def _rfind(seq: list[int], pattern: list[int], end: int | None = None) -> int:
    """Index of the last occurrence of ``pattern`` in ``seq[:end]``, or -1."""
    n = len(pattern)
    stop = len(seq) if end is None else end
    for i in range(stop - n, -1, -1):
        if seq[i : i + n] == pattern:
            return i
    return -1


class EchoLayer(nn.Module):
    """Attention-free layer; exists so mlx-lm makes one KV cache for it."""

    def __call__(self, ids: mx.array, cache: Any) -> mx.array:
        keys = (ids.astype(mx.float32) + 1.0)[:, None, :, None]
        if cache is None:
            return keys
        stored, values = cache.update_and_fetch(keys, keys)
        # a transformer reads its values and the cache offset (attention, RoPE)
        # every step; without that, their lazy updates would pile up
        mx.eval(values, cache.offset)
        return stored


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.layers = [EchoLayer()]
        self.scale = mx.array([30.0], dtype=mx.float32)

    def next_token(self, seq: list[int]) -> int:
        """The token the echo emits after the tokens ``seq``."""
        a = self.args
        start = _rfind(seq, a.assistant_header_ids)
        if start < 0:
            return a.eos_token_id
        gen_start = start + len(a.assistant_header_ids)
        skip = a.think_skip_ids
        if skip and seq[gen_start : gen_start + len(skip)] == skip:
            gen_start += len(skip)
        u = _rfind(seq, a.user_header_ids, start)
        if u < 0:
            return a.eos_token_id
        span_start = u + len(a.user_header_ids)
        try:
            span_end = seq.index(a.end_token_id, span_start, start)
        except ValueError:
            span_end = start
        span = seq[span_start:span_end]
        nl = a.newline_ids
        if nl and span[: len(nl)] == nl:
            span = span[len(nl) :]
        elif span and str(span[0]) in a.newline_fused:
            span = a.newline_fused[str(span[0])] + span[1:]
        produced = len(seq) - gen_start
        if produced < 0 or produced >= len(span):
            return a.eos_token_id
        return span[produced]

    def __call__(
        self,
        inputs: mx.array,
        cache: Any = None,
        input_embeddings: mx.array | None = None,
        **kwargs: Any,
    ) -> mx.array:
        layer_cache = cache[0] if cache is not None else None
        stored = self.layers[0](inputs, layer_cache)
        rows = np.asarray(stored[:, 0, :, 0]).astype(np.int64) - 1
        # a batch cache's left padding is not the row's (it may hold stale ids
        # once speculative decoding has rolled rejected positions into it)
        padding = getattr(layer_cache, "left_padding", None)
        pads = np.asarray(padding).tolist() if padding is not None else [0] * len(rows)
        length = inputs.shape[1] if self.args.all_positions else 1
        targets = []
        for row, pad in zip(rows, pads, strict=True):
            seq = [int(t) for t in row[pad:] if t > 0]
            # the next token after each input position (speculative decoding reads them all)
            cut = len(seq) - length
            targets.append([self.next_token(seq[: cut + p + 1]) for p in range(length)])
        vocab = mx.arange(self.args.vocab_size)[None, None, :]
        target = mx.array(targets)[:, :, None]
        return mx.where(vocab == target, self.scale, -self.scale).astype(mx.float32)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return weights
