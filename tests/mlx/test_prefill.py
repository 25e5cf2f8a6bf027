"""Prefill at each prompt's own length (short chunks padded together) gives mlx-lm's results."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from afm_core._mlx.batch import Occupancy, occupancy
from afm_core._mlx.prefill import PAD_WASTE, EngineBatchGenerator, EnginePromptBatch, padded_groups


@pytest.fixture(scope="module")
def model(random_model_dir: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(random_model_dir))[0]


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # lengths from 1 (a prompt that is only its last token) to past two prefill chunks
    return [[rng.randrange(3, 1000) for _ in range(rng.choice([1, 2, 7, 31, 33, 70]))] for _ in range(n)]


def prefixed_caches(model: Any, prompts: list[list[int]]) -> tuple[list[Any], list[list[int]]]:
    """Caches already holding the first part of some prompts (as prefix-cache
    hits give), and what is left of each prompt."""
    caches: list[Any] = []
    rest: list[list[int]] = []
    for i, p in enumerate(prompts):
        if i % 3 == 1 and len(p) > 4:
            cache = make_prompt_cache(model)
            cut = len(p) // 2
            model(mx.array(p[:cut])[None], cache=cache)
            mx.eval([c.state for c in cache])
            caches.append(cache)
            rest.append(p[cut:])
        else:
            caches.append(None)
            rest.append(p)
    return caches, rest


def run(gen: Any, prompts: list[list[int]], *, caches: list[Any] | None = None,
        all_tokens: list[list[int]] | None = None,
        remove_at: dict[int, int] | None = None) -> dict[int, tuple[list[int], list[mx.array]]]:
    """Generate 8 tokens per prompt; ``remove_at`` maps a row to the step at
    which it is removed (while it may still be prefilling)."""
    # a repetition penalty reads each row's tokens so far (prompt included)
    procs = [make_logits_processors(repetition_penalty=1.5) if i % 2 == 0 else [] for i in range(len(prompts))]
    uids = gen.insert(prompts, max_tokens=[8] * len(prompts), caches=caches, all_tokens=all_tokens,
                      logits_processors=procs)
    out: dict[int, tuple[list[int], list[mx.array]]] = {i: ([], []) for i in range(len(prompts))}
    row = {u: i for i, u in enumerate(uids)}
    steps = 0
    while True:
        for i, at in (remove_at or {}).items():
            if at == steps:
                gen.remove([uids[i]])
        steps += 1
        _, responses = gen.next()
        for r in responses:
            toks, lps = out[row[r.uid]]
            toks.append(r.token)
            lps.append(r.logprobs)
        if occupancy(gen).empty:
            break
    gen.close()
    return out


def generators(model: Any) -> tuple[Any, Any]:
    kw: dict[str, Any] = {"stop_tokens": [], "completion_batch_size": 5, "prefill_batch_size": 3,
                          "prefill_step_size": 32}
    return BatchGenerator(model, **kw), EngineBatchGenerator(model, logprob_uids=set(), **kw)


def assert_same(ours: dict[int, Any], theirs: dict[int, Any]) -> None:
    assert ours.keys() == theirs.keys()
    for i in ours:
        assert ours[i][0] == theirs[i][0], i
        # the first token's log-probabilities come from the prefill (later ones
        # are only kept for rows that ask for them)
        if ours[i][1]:
            assert mx.allclose(ours[i][1][0], theirs[i][1][0], atol=1e-5).item(), i


def test_same_tokens_as_mlx_lm_for_mixed_lengths_and_chunks(model: Any) -> None:
    prompts = mixed_prompts(11)
    plain, engine = generators(model)
    theirs = run(plain, prompts)
    ours = run(engine, prompts)
    assert all(len(t) == 8 for t, _ in ours.values())
    assert_same(ours, theirs)


def test_same_tokens_with_prefix_cache_rows(model: Any) -> None:
    prompts = mixed_prompts(9, seed=1)
    plain, engine = generators(model)
    results = []
    for gen in (plain, engine):
        caches, rest = prefixed_caches(model, prompts)  # (generators extend both in place)
        seen = [p[: len(p) - len(r)] for p, r in zip(prompts, rest, strict=True)]
        results.append(run(gen, rest, caches=caches, all_tokens=seen))
    theirs, ours = results
    assert_same(ours, theirs)


def test_removing_rows_while_they_prefill(model: Any) -> None:
    prompts = mixed_prompts(8, seed=2)
    remove_at = {0: 1, 4: 2, 5: 3}
    plain, engine = generators(model)
    theirs = run(plain, prompts)
    ours = run(engine, prompts, remove_at=remove_at)
    for i in range(len(prompts)):
        if i in remove_at:  # whatever it had produced: the start of its output
            assert theirs[i][0][: len(ours[i][0])] == ours[i][0]
        else:
            assert ours[i][0] == theirs[i][0], i
    assert len(ours[0][0]) < 8


def test_a_prompt_starts_decoding_in_the_step_its_prefill_ends(model: Any) -> None:
    """mlx-lm moves it at the start of the next step: its first token comes a step later."""
    firsts = []
    for gen in generators(model):
        gen.insert([[5, 6, 7, 8]], max_tokens=[2])
        steps = 0
        while True:
            steps += 1
            if gen.next()[1]:
                break
        firsts.append(steps)
        gen.close()
    assert firsts == [3, 2]


class Recording:
    """``model`` that records (batch, length, single-sequence cache?) of every call."""

    def __init__(self, model: Any):
        self.model = model
        self.calls: list[tuple[int, int, bool]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: Any = None, **kw: Any) -> Any:
        self.calls.append((inputs.shape[0], inputs.shape[1], isinstance(cache[0], KVCache)))
        return self.model(inputs, cache=cache, **kw)


def test_only_real_tokens_are_computed(model: Any) -> None:
    """A prompt too long to pad is prefilled alone at its own length; short
    ones starting together run in padded groups of at most ``PAD_WASTE``
    times their tokens: fewer rows than mlx-lm's padding either way."""
    prompts = mixed_prompts(7, seed=3)
    ours, theirs = Recording(model), Recording(model)
    kw: dict[str, Any] = {"stop_tokens": [], "completion_batch_size": 5, "prefill_batch_size": 3,
                          "prefill_step_size": 32}
    run(EngineBatchGenerator(ours, logprob_uids=set(), **kw), prompts)
    run(BatchGenerator(theirs, **kw), prompts)
    alone = [(b, n) for b, n, single in ours.calls if single]
    padded = [(b, n) for b, n, single in ours.calls if not single and n > 1]
    assert alone and all(b == 1 for b, _ in alone)
    assert padded and all(b > 1 for b, _ in padded)
    # all but each prompt's last token, each computed once, padding within its bound
    tokens = sum(len(p) - 1 for p in prompts)
    assert tokens <= sum(b * n for b, n in alone + padded) <= PAD_WASTE * tokens
    # mlx-lm pads each group to its longest prompt: same schedule, more rows
    assert not any(single for _, _, single in theirs.calls)
    rows = [sum(b * n for b, n, _ in r.calls) for r in (ours, theirs)]
    assert rows[0] < rows[1]


def test_short_chunks_on_equal_caches_run_as_one_padded_batch(model: Any) -> None:
    """A burst's later chunks (caches of equal lengths, chunks of different
    lengths): one call with the chunks padded on the right, each row's cache
    then what prefilling it alone gives, padding trimmed off."""
    rng = random.Random(5)
    first = [[rng.randrange(3, 1000) for _ in range(8)] for _ in range(4)]
    second = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 9, 3, 9)]
    recording = Recording(model)
    caches = [make_prompt_cache(model) for _ in range(4)]
    batch = EnginePromptBatch(recording, [0, 1, 2, 3], caches, samplers=[None] * 4,
                              logits_processors=[()] * 4, max_tokens=[8] * 4)
    batch.prompt(first)
    batch.prompt(second)
    assert [(b, n) for b, n, single in recording.calls] == [(4, 8), (4, 9)]
    for i in range(4):
        alone = make_prompt_cache(model)
        for chunk in (first[i], second[i]):
            model(mx.array(chunk)[None], cache=alone)
        for ours, ref in zip(batch.rows[i], alone, strict=True):
            n = 8 + len(second[i])
            assert ours.offset == ref.offset == n
            for a, b in ((ours.keys, ref.keys), (ours.values, ref.values)):
                assert mx.allclose(a[..., :n, :], b[..., :n, :], atol=1e-5, rtol=1e-5).item(), i


def test_padded_groups_bound_their_padding() -> None:
    assert padded_groups([60, 58, 61, 55]) == [[2, 0, 1, 3]]
    assert padded_groups([10]) == []  # a group is two or more
    assert padded_groups([100, 10, 12]) == [[2, 1]]  # 100 alone: padding 10 to it is waste
    for lengths in ([5, 9, 17, 33, 64, 65, 3, 3], [1, 2, 3, 4, 5, 6, 7, 8], [200, 150, 120, 90]):
        groups = padded_groups(lengths)
        seen = [i for g in groups for i in g]
        assert len(seen) == len(set(seen)) and all(len(g) > 1 for g in groups)
        for g in groups:
            assert len(g) * max(lengths[i] for i in g) <= PAD_WASTE * sum(lengths[i] for i in g)


def test_split_moves_rows_without_copying(model: Any) -> None:
    caches = [make_prompt_cache(model) for _ in range(4)]
    batch = EnginePromptBatch(model, [10, 11, 12, 13], caches, samplers=[None] * 4,
                              logits_processors=[()] * 4, max_tokens=[8] * 4)
    batch.prompt([[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]])
    moved = batch.split([3, 1])
    assert moved.uids == [11, 13] and batch.uids == [10, 12]
    assert moved.rows[0] is caches[1] and moved.rows[1] is caches[3]
    assert batch.rows[0] is caches[0] and batch.rows[1] is caches[2]
    assert batch.tokens == [[5, 6, 7], [9, 10]]
    # the generator's cache size (the prefix cache's budget) counts every row cache
    gen = EngineBatchGenerator(model, logprob_uids=set(), stop_tokens=[])
    gen._prompt_batch = batch
    assert gen.prompt_cache_nbytes == sum(c.nbytes for row in caches[::2] for c in row) > 0
    gen.close()
    assert batch.extract_cache(1) is caches[2]


def test_the_decode_batch_stays_within_its_size(model: Any) -> None:
    prompts = mixed_prompts(9, seed=4)
    widest = []
    for gen in generators(model):  # completion_batch_size 5
        gen.insert(prompts, max_tokens=[6] * len(prompts))
        most = 0
        while not occupancy(gen).empty:
            gen.next()
            most = max(most, occupancy(gen).decoding)
        gen.close()
        widest.append(most)
    assert widest[1] <= max(widest[0], 5)


def test_occupancy_follows_each_row_from_waiting_to_done(model: Any) -> None:
    for gen in generators(model):  # completion 5, prefill 3, chunks of 32
        assert occupancy(gen) == Occupancy(decoding=0, prefilling=0, waiting=0) and occupancy(gen).empty
        uids = gen.insert([[3 + i] * 40 for i in range(8)], max_tokens=[4] * 8)
        assert occupancy(gen) == Occupancy(decoding=0, prefilling=0, waiting=8)
        gen.remove([uids[-1]])  # a request that never started
        assert occupancy(gen) == Occupancy(decoding=0, prefilling=0, waiting=7)
        gen.next()
        assert occupancy(gen) == Occupancy(decoding=0, prefilling=3, waiting=4)  # one group, first chunk
        if isinstance(gen, EngineBatchGenerator):
            assert gen.occupancy() == occupancy(gen)
        left = [7]
        while not occupancy(gen).empty:
            gen.next()
            now = occupancy(gen)
            assert now.decoding <= 5 and now.prefilling <= 3
            left.append(now.decoding + now.prefilling + now.waiting)
        assert left == sorted(left, reverse=True)  # a row only ever moves on
        gen.close()


def test_prefill_cost_counts_the_products_and_the_keys(model: Any) -> None:
    from afm_core._mlx.prefill import MIN_CHUNK, PrefillCost

    cost = PrefillCost.of(model)
    args = model.args
    head = args.head_dim or args.hidden_size // args.num_attention_heads
    kv = args.num_key_value_heads * head
    q = args.num_attention_heads * head
    per_layer = args.hidden_size * (2 * q + 2 * kv) + 3 * args.hidden_size * args.intermediate_size
    assert cost.per_token == args.num_hidden_layers * per_layer
    assert cost.per_key == 2 * args.num_hidden_layers * args.num_attention_heads * head
    # a chunk deep into a prompt holds fewer tokens; several prompts share the budget
    sizes = [cost.chunk(256, [o]) for o in (0, 1000, 10_000, 100_000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] < 256 and sizes[-1] >= MIN_CHUNK
    n = cost.chunk(256, [0, 500])
    for offsets, got in (([0], sizes[0]), ([0, 500], n)):
        spent = sum(got * (cost.per_token + cost.per_key * (o + got / 2)) for o in offsets)
        over = sum((got + 1) * (cost.per_token + cost.per_key * (o + (got + 1) / 2)) for o in offsets)
        assert spent <= 256 * cost.per_token < over  # the most that fits
    assert cost.chunk(256, [10**9]) == MIN_CHUNK


def test_running_streams_get_a_token_between_the_chunks_of_a_long_prompt(model: Any) -> None:
    """While a stream decodes, a long prompt is prefilled in chunks of about
    ``prefill_step_decoding`` tokens' cost, each step also giving the
    running stream its token; alone, it goes ``prefill_step`` at a time."""
    from afm_core._mlx.prefill import PrefillCost

    kw: dict[str, Any] = {"stop_tokens": [], "completion_batch_size": 4, "prefill_batch_size": 2,
                          "prefill_step_size": 512}
    gen = EngineBatchGenerator(model, logprob_uids=set(), prefill_step_decoding=40, **kw)
    (running,) = gen.insert([[5, 6, 7]], max_tokens=[10_000])
    while not gen.next()[1]:
        pass  # until it decodes
    long = [(i * 7) % 900 + 3 for i in range(1000)]
    (waiting,) = gen.insert([long], max_tokens=[2])
    done, chunks, tokens = 0, [], 0
    cost = PrefillCost.of(model)
    while True:
        prompt_responses, responses = gen.next()
        tokens += sum(r.uid == running for r in responses)
        mine = [p for p in prompt_responses if p.uid == waiting]
        if any(r.uid == waiting for r in responses):
            break
        assert mine, "a step that prefilled nothing"
        assert any(r.uid == running for r in responses), "the running stream got no token"
        step = mine[-1].progress[0] - done
        assert step <= max(cost.chunk(40, [done]), 0) or mine[-1].end_of_prompt
        chunks.append(step)
        done = mine[-1].progress[0]
    assert len(chunks) > 1000 // 512 + 1 and tokens >= len(chunks)
    assert chunks[:-1] == sorted(chunks[:-1], reverse=True)  # later chunks hold fewer tokens
    gen.close()
    # alone, the same prompt goes prefill_step_size tokens at a time
    alone = EngineBatchGenerator(model, logprob_uids=set(), prefill_step_decoding=40, **kw)
    (uid,) = alone.insert([long], max_tokens=[2])
    steps = 0
    while not any(r.uid == uid for r in alone.next()[1]):
        steps += 1
    assert steps == 2  # 512, then the rest
    alone.close()


def test_a_first_token_is_sent_before_the_next_prefill_chunk(model: Any) -> None:
    """The step after a row's prefill ends only decodes: its first token (and
    the running rows' tokens) come out without waiting for another chunk of
    the prompts still prefilling."""
    kw: dict[str, Any] = {"stop_tokens": [], "completion_batch_size": 4, "prefill_batch_size": 2,
                          "prefill_step_size": 64}
    gen = EngineBatchGenerator(model, logprob_uids=set(), **kw)
    short, long = gen.insert([[5, 6, 7], [(i * 7) % 900 + 3 for i in range(300)]], max_tokens=[4, 2])
    prompt_responses, responses = gen.next()
    assert [p.uid for p in prompt_responses if p.end_of_prompt] == [short] and not responses
    prompt_responses, responses = gen.next()  # the short one's first token, nothing prefilled
    assert [r.uid for r in responses] == [short] and prompt_responses == []
    prompt_responses, responses = gen.next()  # then the long prompt's next chunk, with a token
    assert [r.uid for r in responses] == [short]
    assert [(p.uid, p.progress[0]) for p in prompt_responses] == [(long, 128)]
    gen.close()


def test_prompts_outnumbering_the_decoding_streams_get_a_larger_chunk(model: Any) -> None:
    """While streams decode, the prompts of a step share ``prefill_step_decoding``
    tokens' cost, times how many more prompts there are than decoding streams:
    a burst of requests behind one stream is not cut finer than that stream
    alone would cut a single prompt."""
    from afm_core._mlx.prefill import PrefillCost

    kw: dict[str, Any] = {"stop_tokens": [], "completion_batch_size": 8, "prefill_batch_size": 8,
                          "prefill_step_size": 512}
    cost = PrefillCost.of(model)
    for waiting in (1, 3, 6):
        gen = EngineBatchGenerator(model, logprob_uids=set(), prefill_step_decoding=40, **kw)
        (running,) = gen.insert([[5, 6, 7]], max_tokens=[10_000])
        while not gen.next()[1]:
            pass  # until it decodes
        prompts = [[(i * 7 + j) % 900 + 3 for i in range(400)] for j in range(waiting)]
        uids = gen.insert(prompts, max_tokens=[2] * waiting)
        prompt_responses, responses = gen.next()
        assert [r.uid for r in responses] == [running]
        got = {p.uid: p.progress[0] for p in prompt_responses}
        assert got == dict.fromkeys(uids, cost.chunk(40 * waiting, [0] * waiting))
        gen.close()
