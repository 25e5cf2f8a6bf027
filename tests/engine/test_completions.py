"""Raw-prompt completions through the engine (CompletionRequest), on the echo
and random tiny models: the same output as mlx-lm's own generators, prompt
logprobs equal to a direct forward pass, max_tokens 0, ignore_eos, suffix
without FIM tokens, and cancellation that really stops the work."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.generate import BatchGenerator

from afm_core import (
    CompletionRequest,
    ContentDelta,
    DecoderTables,
    Finish,
    IncrementalDetokenizer,
    LogprobsDelta,
    PromptLogprobs,
    RequestError,
    StreamFailure,
    UnsupportedError,
    Usage,
    open_engine,
)
from afm_core._engine.engine import Engine
from afm_core._engine.prepare import FIM_TOKENS, completion_prompt, continuation_tables, fim_tokens
from afm_core._models.loader import ModelInfo
from tests.engine.test_engine import settled, wait_for

CHAT_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def raw(prompt: str | list[int] | tuple[int, ...], **kw: Any) -> CompletionRequest:
    if isinstance(prompt, list):
        prompt = tuple(prompt)
    return CompletionRequest.from_openai(kw, prompt)


async def run(engine: Engine, request: CompletionRequest, **kw: Any) -> tuple[list, PromptLogprobs | None]:
    async with engine.stream(request, **kw) as s:
        events = [e async for e in s]
        return events, s.prompt_logprobs


def text(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


@pytest.fixture(scope="module")
def random_mlx(random_model_dir: Path) -> tuple[Any, Any]:
    import mlx_lm

    return mlx_lm.load(str(random_model_dir))  # type: ignore[return-value]


def mlx_lm_greedy(model: Any, prompt: list[int], max_tokens: int, stop: list[int]) -> list[int]:
    """mlx-lm's own BatchGenerator, one prompt, greedy: the reference tokens."""
    gen = BatchGenerator(model, stop_tokens=[[t] for t in stop], completion_batch_size=1,
                         prefill_batch_size=1)
    gen.insert([prompt], max_tokens=[max_tokens])
    out: list[int] = []
    while True:
        _, responses = gen.next()
        for r in responses:
            out.append(r.token)
            if r.finish_reason is not None:
                gen.close()
                return out


def forward_logprobs(model: Any, prompt: list[int]) -> mx.array:
    """log_softmax of one forward pass over the whole prompt (float32)."""
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# -- output equals mlx-lm's ---------------------------------------------------------


async def test_echo_model_raw_prompt_equals_mlx_lm_generate(echo_model_dir: Path) -> None:
    import mlx_lm

    model, tok = mlx_lm.load(str(echo_model_dir))
    prompt = CHAT_PROMPT.format("raw prompts, no template: wörld 東京")
    ids = tok.encode(prompt)
    expected = mlx_lm.generate(model, tok, prompt=ids, max_tokens=60)
    async with open_engine(echo_model_dir) as engine:
        for request in (raw(prompt, max_tokens=60, temperature=0), raw(ids, max_tokens=60, temperature=0)):
            events, scored = await run(engine, request)
            assert text(events) == expected == "raw prompts, no template: wörld 東京"
            assert events[-2] == Finish("stop") and scored is None
            usage = events[-1]
            assert usage.prompt_tokens == len(ids)
            assert usage.completion_tokens == len(tok.encode(expected)) + 1  # and the EOS
        # no template was applied: a plain text prompt has no user turn to echo
        events, _ = await run(engine, raw("just text", max_tokens=5))
        assert text(events) == "" and events[-2] == Finish("stop")


async def test_random_model_greedy_equals_mlx_lm_batch_generator(random_model_dir: Path,
                                                                 random_mlx: tuple[Any, Any]) -> None:
    model, tok = random_mlx
    eos = sorted(tok.eos_token_ids)
    rng = random.Random(3)
    prompts: list[str | list[int]] = ["The capital of France is", "def add(a, b):\n    return",
                                      [rng.randrange(3, 1000) for _ in range(40)]]
    async with open_engine(random_model_dir, cpu_fusion=False, prefix_cache_bytes=0) as engine:
        for prompt in prompts:
            ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
            want = mlx_lm_greedy(model, ids, 24, eos)
            events, _ = await run(engine, raw(prompt, max_tokens=24, temperature=0))
            assert text(events) == tok.decode([t for t in want if t not in eos])
            assert events[-1].completion_tokens == len(want)
            # ignore_eos: exactly max_tokens tokens, the EOS among them as mlx-lm without stop tokens
            want = mlx_lm_greedy(model, ids, 30, [])
            events, _ = await run(engine, raw(prompt, max_tokens=30, temperature=0, ignore_eos=True,
                                              logprobs=0))
            assert events[-2] == Finish("length") and events[-1].completion_tokens == 30 == len(want)
            assert text(events) == tok.decode(want, skip_special_tokens=True)
            scored = [e for e in events if isinstance(e, LogprobsDelta)]
            assert len(scored) == 30  # one per token, EOS included


async def test_stop_strings_and_sampling_settings_apply(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        prompt = CHAT_PROMPT.format("alpha beta STOP gamma")
        events, _ = await run(engine, raw(prompt, stop=["STOP"], max_tokens=40))
        assert text(events) == "alpha beta " and events[-2] == Finish("stop")
        events, _ = await run(engine, raw(prompt, max_tokens=3))
        assert events[-2] == Finish("length") and events[-1].completion_tokens == 3
        tid = engine._tokenizer.encode("Z", add_special_tokens=False)[0]
        events, _ = await run(engine, raw(prompt, max_tokens=4, temperature=0, logit_bias={str(tid): 100}))
        assert text(events) == "ZZZZ"


# -- prompt logprobs ---------------------------------------------------------------------


@pytest.mark.parametrize("prefill_step", [2048, 100])
async def test_prompt_logprobs_equal_a_direct_forward_pass(random_model_dir: Path, random_mlx: tuple[Any, Any],
                                                           prefill_step: int) -> None:
    model, tok = random_mlx
    rng = random.Random(prefill_step)
    # longer than one scoring span (256) and, at prefill_step 100, several prefill chunks
    ids = [rng.randrange(3, 1000) for _ in range(300)]
    ref = forward_logprobs(model, ids)
    # (kv_dtype "model": the reference is a float32 forward pass; a float16 cache rounds keys and values)
    async with open_engine(random_model_dir, prefill_step=prefill_step, kv_dtype="model") as engine:
        events, scored = await run(engine, raw(ids, max_tokens=2, temperature=0, logprobs=3, echo=True))
        assert scored is not None
        assert scored.ids == tuple(ids)
        assert scored.tokens == tuple(tok.decode([i]) for i in ids)
        assert scored.logprobs[0] is None and scored.top_logprobs[0] == ()
        want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
        got = list(scored.logprobs[1:])
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
        for pos in range(1, len(ids)):
            top = scored.top_logprobs[pos]
            values = sorted(ref[pos - 1].tolist(), reverse=True)[:3]
            assert len(top) == 3 and [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
            assert max(abs(t.logprob - v) for t, v in zip(top, values, strict=True)) < 1e-4
            assert top[0].logprob >= scored.logprobs[pos] - 1e-6
        # the generated tokens are the greedy ones, scored as usual
        assert events[-2] == Finish("length") and events[-1] == Usage(300, 2, 0)
        assert sum(isinstance(e, LogprobsDelta) for e in events) == 2


async def test_scoring_skips_the_prefix_cache_and_leaves_other_requests_alone(random_model_dir: Path) -> None:
    rng = random.Random(9)
    ids = [rng.randrange(3, 1000) for _ in range(50)]
    other = "A plain completion next to a scored one"
    async with open_engine(random_model_dir, cpu_fusion=False) as engine:
        alone, _ = await run(engine, raw(other, max_tokens=16, temperature=0))
        _, a = await run(engine, raw(ids, max_tokens=1, echo=True, logprobs=1, temperature=0))
        results: dict[str, Any] = {}

        async def one(name: str, request: CompletionRequest) -> None:
            results[name] = await run(engine, request)

        async with trio.open_nursery() as n:  # prefilled together, decoded together
            n.start_soon(one, "scored", raw(ids, max_tokens=1, echo=True, logprobs=1, temperature=0))
            n.start_soon(one, "plain", raw(other, max_tokens=16, temperature=0))
        events, b = results["scored"]
        assert a is not None and b is not None and a.logprobs == b.logprobs
        assert events[-1].cached_tokens == 0  # the same prompt ran before: scored, not cached
        plain = results["plain"][0]
        assert text(plain) == text(alone) and plain[-1].completion_tokens == alone[-1].completion_tokens


async def test_max_tokens_zero(random_model_dir: Path) -> None:
    async with open_engine(random_model_dir) as engine:
        before = await settled(engine)
        events, scored = await run(engine, raw("nothing to generate", max_tokens=0))
        assert events == [Finish("length"), Usage(events[-1].prompt_tokens, 0, 0)] and scored is None
        after = await settled(engine)
        assert after.steps == before.steps and after.generation_tokens == before.generation_tokens
        # scored: the prompt's logprobs, still no token
        events, scored = await run(engine, raw("score me only", max_tokens=0, echo=True, logprobs=2))
        assert events[:-1] == [Finish("length")] and events[-1].completion_tokens == 0
        assert scored is not None and len(scored.ids) == events[-1].prompt_tokens
        assert scored.logprobs[0] is None and all(v is not None and v <= 0 for v in scored.logprobs[1:])
        assert (await settled(engine)).generation_tokens == before.generation_tokens
        # a one-token prompt has nothing to score but its first token
        events, scored = await run(engine, raw([42], max_tokens=0, echo=True, logprobs=1))
        assert scored is not None and scored.logprobs == (None,) and scored.top_logprobs == ((),)


async def test_a_model_without_per_position_logits_cannot_score(echo_model_dir: Path) -> None:
    # the echo model returns the last position's logits only
    async with open_engine(echo_model_dir) as engine:
        events, scored = await run(engine, raw(CHAT_PROMPT.format("hi"), echo=True, logprobs=1))
        (failure,) = events
        assert isinstance(failure, StreamFailure) and failure.code == "unsupported"
        assert failure.type == "invalid_request_error" and scored is None
        events, _ = await run(engine, raw(CHAT_PROMPT.format("still fine")))
        assert text(events) == "still fine"


# -- prompts the engine refuses --------------------------------------------------------


async def test_bad_prompts_are_request_errors(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        vocab = min(engine.info.vocab_size, len(engine._tokenizer))
        for request, param in [(raw([1, vocab]), "prompt[1]"), (raw("x", suffix="y"), "suffix"),
                               (raw("x", max_tokens=40000), "max_tokens"),
                               (raw(list(range(5, 900)) * 40), "prompt")]:
            with pytest.raises(RequestError) as info:
                async with engine.stream(request):
                    pass
            assert info.value.param == param and info.value.status == 400
        with pytest.raises(UnsupportedError, match="fill-in-the-middle"):
            async with engine.stream(raw("x", suffix="")):
                pass
        with pytest.raises(TypeError, match=r"chat\.completion"):
            await engine.complete(raw("x"))  # type: ignore[arg-type]
        assert engine.statistics().requests_active == 0


def test_fim_tokens_are_found_by_their_spellings(echo_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(echo_model_dir))
    assert fim_tokens(tok) is None
    pre, suf, mid = FIM_TOKENS[1]
    tok.add_special_tokens({"additional_special_tokens": [pre, suf, mid]})
    ids = fim_tokens(tok)
    assert ids is not None and [tok.convert_ids_to_tokens(i) for i in ids] == [pre, suf, mid]
    info = ModelInfo(id="fim", path=echo_model_dir, context_length=4096, vocab_size=len(tok),
                     think_tags=None, tool_format=None, chat_template="")
    got = completion_prompt(raw("def f(x):", suffix="    return y"), tok, info)
    assert got == [ids[0], *tok.encode("def f(x):", add_special_tokens=False), ids[1],
                   *tok.encode("    return y", add_special_tokens=False), ids[2]]
    got = completion_prompt(raw([7, 8], suffix="end"), tok, info)
    assert got == [ids[0], 7, 8, ids[1], *tok.encode("end", add_special_tokens=False), ids[2]]


def test_continuation_text_keeps_the_leading_space() -> None:
    from tests.stream.tokenizers import sentencepiece

    tok = sentencepiece()
    tables = DecoderTables.from_tokenizer(tok)
    assert tables.strip_count  # Llama's decoder strips the first space of a text
    ids = tok.encode("The quick brown fox jumps", add_special_tokens=False).ids
    cut = max(i for i, t in enumerate(ids) if tok.id_to_token(t).startswith("\u2581"))  # a word's start
    prompt, gen = ids[:cut], ids[cut:]
    plain = IncrementalDetokenizer(tables).feed_many(gen)
    cont = IncrementalDetokenizer(continuation_tables(tables)).feed_many(gen)
    assert cont == " " + plain and not plain.startswith(" ")
    assert tok.decode(prompt + gen) == tok.decode(prompt) + cont


# -- cancellation ------------------------------------------------------------------------


async def test_cancel_by_id_and_group_stop_generation(echo_model_dir: Path) -> None:
    # EOS forever (skipped as text; each token has its logprobs event): it never ends on its own
    long = raw(CHAT_PROMPT.format("x"), max_tokens=20000, ignore_eos=True, logprobs=0)
    async with open_engine(echo_model_dir) as engine:
        got: dict[str, list] = {"a": [], "a/1": [], "b": []}

        async def reader(rid: str, group: str | None) -> None:
            async with engine.stream(long, request_id=rid, group=group) as s:
                async for e in s:
                    got[rid].append(e)

        async with trio.open_nursery() as n:
            n.start_soon(reader, "a", None)
            n.start_soon(reader, "a/1", "a")
            n.start_soon(reader, "b", None)
            await wait_for(lambda: all(len(v) >= 5 for v in got.values()))
            assert engine.cancel("a") is True  # a and its group member
            await wait_for(lambda: all(Finish("cancelled") in got[k] for k in ("a", "a/1")))
            assert Finish("cancelled") not in got["b"]
            assert engine.cancel("b")
        for k in got:
            assert got[k][-2] == Finish("cancelled") and got[k][-1].completion_tokens < 20000
        assert engine.cancel("a") is False
        stats = await settled(engine)
        assert stats.running == 0 and stats.requests_active == 0 and not engine._groups
        assert (await settled(engine)).steps == stats.steps  # nothing more is generated


async def test_leaving_the_stream_stops_generation(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        seen = 0
        with trio.CancelScope() as scope:
            async with engine.stream(raw(CHAT_PROMPT.format("y"), max_tokens=20000, ignore_eos=True,
                                         logprobs=1)) as s:
                async for e in s:
                    seen += isinstance(e, LogprobsDelta)
                    if seen >= 5:
                        scope.cancel()
        assert scope.cancelled_caught
        stats = await settled(engine)
        assert stats.running == 0 and stats.requests_active == 0
        assert stats.generation_tokens < 20000
        assert (await settled(engine)).steps == stats.steps


# -- tokenize / detokenize --------------------------------------------------------------


async def test_tokenize_detokenize_and_pieces(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        tok = engine._tokenizer
        text_in = "Hello <|im_start|> wörld 東京 🚀"
        ids = await engine.tokenize(text_in)
        assert ids == tok.encode(text_in, add_special_tokens=False)
        assert await engine.detokenize(ids) == text_in == tok.decode(ids)
        assert await engine.tokenize(text_in, parse_special=False) != ids
        assert b"".join(await engine.token_pieces(ids)) == text_in.encode()
        special = tok.convert_tokens_to_ids("<|im_start|>")
        assert special in ids and await engine.token_pieces([special]) == [b"<|im_start|>"]
        with pytest.raises(RequestError) as info:
            await engine.detokenize([1, -1])
        assert info.value.param == "tokens[1]"
        with pytest.raises(RequestError):
            await engine.token_pieces([10**9])
        # what a CompletionRequest would run from
        assert await engine.tokenize_chat(raw(text_in)) == tok.encode(text_in)
