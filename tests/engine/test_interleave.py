"""A long prompt arriving while a stream decodes is prefilled in small chunks
(``prefill_step_decoding``), the running stream getting a token between them;
alone, it is prefilled ``prefill_step`` tokens at a time."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import trio

from afm_core import CompletionRequest, ContentDelta, LogprobsDelta, PromptProgress, open_engine
from afm_core._engine.engine import ChatStream


def raw(ids: list[int], **kw: Any) -> CompletionRequest:
    return CompletionRequest.from_openai({"temperature": 0, "ignore_eos": True, "logprobs": 0, **kw}, tuple(ids))


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


async def chunks_of(stream: ChatStream) -> list[int]:
    """The processed counts of a stream's prefill chunks, until its first token."""
    seen = []
    with trio.fail_after(60):
        async for e in stream:
            if isinstance(e, PromptProgress):
                seen.append(e.processed)
            if isinstance(e, ContentDelta | LogprobsDelta):
                break
    return seen


async def test_a_long_prompt_is_chunked_finely_while_a_stream_decodes(random_model_dir: Path) -> None:
    ids = prompt_ids(1200, seed=1)
    async with open_engine(random_model_dir, prefill_step=512, prefill_step_decoding=40,
                           prefix_cache_bytes=0, warmup=False) as engine:
        async with engine.stream(raw(ids, max_tokens=2), progress=True) as s:
            alone = await chunks_of(s)
        async with engine.stream(raw([5, 6, 7], max_tokens=2000), request_id="running") as running:
            with trio.fail_after(60):
                async for e in running:
                    if isinstance(e, ContentDelta | LogprobsDelta):
                        break  # it decodes
            before = engine.statistics().generation_tokens
            async with engine.stream(raw(ids, max_tokens=2), progress=True) as s:
                busy = await chunks_of(s)
            during = engine.statistics().generation_tokens - before
            engine.cancel("running")
    assert alone == [0, 512, 1024, 1199, 1200]
    chunks = len(busy) - 2  # (the admission's and the last token's events are not chunks)
    assert chunks > 3 * (len(alone) - 2)
    assert during >= chunks  # a token for the running stream with every chunk
