"""The log-probability records of generated tokens and of scored prompts.

Runs on the generation thread (it reads MLX arrays); the records it builds
(:class:`~afm_core._stream.events.LogprobsDelta`,
:class:`~.commands.PromptLogprobs`) cross to Trio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._stream.events import LogprobsDelta, TokenLogprob, TopLogprob
from .commands import PromptLogprobs

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .._mlx.prefill import PromptScores


def token_logprobs(tokenizer: TokenizerWrapper, token: int, logprobs: mx.array, k: int) -> LogprobsDelta:
    """The record of one generated ``token``: its log-probability in
    ``logprobs`` (the step's distribution) and the ``k`` likeliest tokens'."""
    from .sampling import top_logprobs

    lp = float(logprobs[token].item())  # type: ignore[arg-type]  # a float array's item is a float
    text = tokenizer.decode([token])
    tops: tuple[TopLogprob, ...] = ()
    if k:
        ids, vals = top_logprobs(logprobs, k)
        tops = tuple(
            TopLogprob(t, v, tuple(t.encode("utf-8")))
            for t, v in ((tokenizer.decode([i]), v) for i, v in zip(ids, vals, strict=True))
        )
    return LogprobsDelta((TokenLogprob(text, lp, tuple(text.encode("utf-8")), tops),))


def prompt_logprobs(tokenizer: TokenizerWrapper, prompt: list[int], scores: PromptScores) -> PromptLogprobs:
    """The record of a scored prompt: each token's text and the alternatives'
    (the first token has no score)."""
    ids = sorted({*prompt, *(i for row in scores.top_ids for i in row)})
    texts = dict(zip(ids, tokenizer.batch_decode([[i] for i in ids]), strict=True))

    def top(row_ids: list[int], row_vals: list[float]) -> tuple[TopLogprob, ...]:
        return tuple(TopLogprob(texts[i], v, tuple(texts[i].encode("utf-8")))
                     for i, v in zip(row_ids, row_vals, strict=True))

    positions = len(prompt) - 1
    tops = [top(i, v) for i, v in zip(scores.top_ids, scores.top_logprobs, strict=True)] \
        if scores.top_ids else [()] * positions
    if len(scores.logprobs) != positions or len(tops) != positions:
        raise RuntimeError(f"scored {len(scores.logprobs)} of the prompt's {positions} positions")
    return PromptLogprobs(
        ids=tuple(prompt),
        tokens=tuple(texts[i] for i in prompt),
        logprobs=(None, *scores.logprobs),
        top_logprobs=((), *tops),
    )
