"""Speculative decoding (prompt lookup, draft model) in the engine: the same
greedy tokens as without it, across batch widths, cancel and grammar."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import trio

from afm_core._engine.engine import Engine, open_engine
from afm_core._mlx import qmatmul, speculative
from afm_core._mlx.speculative import MAX_REST, PromptLookup, Speculation, lookup
from afm_core._stream.events import Finish, Profile
from afm_core.api.chat_request import ChatRequest
from afm_core.testing import make_echo_model, make_random_model

PROMPTS = [
    "the cat sat on the mat and the cat sat on the hat, the cat sat on",
    "one two three four five six seven eight one two three four five",
    "alpha beta gamma delta alpha beta gamma delta epsilon zeta alpha beta",
    "red green blue red green blue red green yellow red green blue",
]


def req(text: str, **kw) -> ChatRequest:
    return ChatRequest.from_openai({"messages": [{"role": "user", "content": text}],
                                    "temperature": 0, **kw})


async def token_ids(engine: Engine, prompts: list[str], max_tokens: list[int]) -> list[tuple[str, int, str]]:
    """Each prompt's completion (text, tokens, finish reason), all streamed at once."""
    out: list[tuple[str, int, str]] = [("", 0, "")] * len(prompts)

    async def one(i: int) -> None:
        r = await engine.complete(req(prompts[i], max_tokens=max_tokens[i], enable_thinking=False))
        choice = r["choices"][0]
        out[i] = (choice["message"]["content"], r["usage"]["completion_tokens"], choice["finish_reason"])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out


@pytest.fixture(scope="module")
def echo_all_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The echo model returning every position's logits (what verifying needs)."""
    return make_echo_model(tmp_path_factory.mktemp("echo-all"), all_positions=True)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second, smaller random model with the test models' tokenizer."""
    return make_random_model(tmp_path_factory.mktemp("draft"), hidden_size=32, num_layers=1, seed=7)


def test_lookup_proposes_what_followed_the_suffix() -> None:
    assert lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert lookup([1, 2, 3, 4, 9, 1, 2, 3], 1) == [4]
    assert lookup([5, 6, 7, 8], 3) == []  # no earlier occurrence
    assert lookup([1, 2, 5, 1, 2], 0) == []
    # the longest suffix wins: (7, 1, 2) -> 8, not (1, 2) -> 3's later match
    assert lookup([7, 1, 2, 8, 1, 2, 3, 7, 1, 2], 1) == [8]
    # a match with k tokens after it beats a later one with fewer
    assert lookup([4] * 6, 3) == [4, 4, 4]


def test_a_row_rests_while_its_guesses_do_not_pay_for_the_verify_step(monkeypatch) -> None:
    spec = Speculation(PromptLookup(), tokens=3, max_batch=1)
    assert spec.needed(1) == 0.0  # nothing timed: any accepted token pays
    spec._rest(7, 1, spec.needed(1))
    assert 7 not in spec.resting
    # a verify step measured at 2.5 plain steps must accept more than 1.5 tokens
    clock = iter([0.0, 0.010, 0.035, 0.045])  # plain step, verify step, then the next call
    monkeypatch.setattr("afm_core._mlx.speculative.time.perf_counter", lambda: next(clock))
    spec._timed(1)
    spec._last = (1, False)
    spec._timed(1)
    spec._last = (1, True)
    spec._timed(1)
    assert spec.needed(1) == pytest.approx(1.5)
    assert spec.needed(2) == 0.0  # another batch width is timed apart
    spec.gain.clear()
    spec._rest(7, 1, spec.needed(1))  # one token a step does not pay
    assert spec.resting[7] == 1
    spec._rest(7, 1, spec.needed(1))
    assert spec.resting[7] == 3  # backs off further, up to MAX_REST
    spec._rest(7, 3, spec.needed(1))  # average (1 + 3) / 2 = 2 > 1.5: pays again
    assert 7 not in spec.misses
    spec.retain([])
    assert not spec.gain and not spec.resting and not spec.misses
    assert MAX_REST >= 3


@pytest.mark.parametrize("model", ["random", "echo"])
@pytest.mark.parametrize("proposer", ["lookup", "draft"])
async def test_greedy_tokens_are_the_same_with_speculation(
        model: str, proposer: str, random_model_dir: Path, echo_all_dir: Path, draft_dir: Path) -> None:
    path = random_model_dir if model == "random" else echo_all_dir
    spec = {"prompt_lookup": 4} if proposer == "lookup" else {"draft_model": str(draft_dir), "draft_tokens": 3}
    if proposer == "draft" and model == "echo":
        spec = {"draft_model": str(path), "draft_tokens": 3}  # the echo drafts for itself: all accepted
    lengths = [40, 25, 33, 18]
    async with open_engine(path, warmup=False, spec_max_batch=0) as engine:
        one_plain = await token_ids(engine, PROMPTS[:1], lengths[:1])
        many_plain = await token_ids(engine, PROMPTS, lengths)
    async with open_engine(path, warmup=False, spec_max_batch=1, **spec) as engine:
        one_spec = await token_ids(engine, PROMPTS[:1], lengths[:1])
        alone = engine.statistics()
        # four at once: plain steps while more than one decodes, speculation once one is left
        many_spec = await token_ids(engine, PROMPTS, lengths)
        stats = engine.statistics()
        assert engine._worker is not None
        spec_state = engine._worker.gen.speculation
        assert spec_state is not None and not spec_state.by_uid
        if proposer == "draft":  # the draft's caches left with their rows
            assert not spec_state.proposer.rows  # type: ignore[attr-defined]
    assert one_spec == one_plain
    assert many_spec == many_plain
    assert alone.spec_steps > 0 and alone.spec_proposed > 0
    assert stats.spec_steps > alone.spec_steps  # it speculated again once the batch narrowed
    assert stats.steps - alone.steps > stats.spec_steps - alone.spec_steps  # and ran plain steps too
    assert 0 <= stats.spec_accepted <= stats.spec_proposed
    if model == "echo":  # the echo repeats its prompt: lookups and its own draft are right
        assert stats.spec_accepted > stats.spec_proposed // 2


async def test_speculation_at_width_with_rows_leaving(random_model_dir: Path, echo_all_dir: Path) -> None:
    """Every step speculates (spec_max_batch 4) while rows of different
    lengths finish and others keep going: the cache surgery of one row must
    not disturb another's."""
    for path in (random_model_dir, echo_all_dir):
        lengths = [7, 31, 16, 45]
        async with open_engine(path, warmup=False, spec_max_batch=0) as engine:
            plain = await token_ids(engine, PROMPTS, lengths)
        async with open_engine(path, warmup=False, spec_max_batch=4, prompt_lookup=5) as engine:
            spec = await token_ids(engine, PROMPTS, lengths)
            assert engine.statistics().spec_steps > 0
        assert spec == plain


@pytest.mark.parametrize("proposer", ["lookup", "draft"])
async def test_cancel_mid_stream_while_speculating(proposer: str, echo_all_dir: Path) -> None:
    text = " ".join(["lorem ipsum dolor sit amet"] * 40)
    spec = {"prompt_lookup": 4} if proposer == "lookup" else {"draft_model": str(echo_all_dir)}
    async with open_engine(echo_all_dir, warmup=False, spec_max_batch=2, **spec) as engine:
        events = []
        async with engine.stream(req(text, max_tokens=150), request_id="victim") as s:
            async for e in s:
                events.append(e)
                if len(events) == 5:
                    assert engine.cancel("victim")
        assert isinstance(next(e for e in events if isinstance(e, Finish)), Finish)
        assert [e.reason for e in events if isinstance(e, Finish)] == ["cancelled"]
        assert engine._worker is not None and engine._worker.gen.speculation is not None
        assert not engine._worker.gen.speculation.by_uid
        assert not getattr(engine._worker.gen.speculation.proposer, "rows", None)
        assert engine.statistics().spec_accepted > 0
        # the engine goes on: the next request is whole
        r = await engine.complete(req("one two one two one two", max_tokens=30))
        assert r["choices"][0]["message"]["content"] == "one two one two one two"


async def test_grammar_stream_next_to_a_speculating_one(random_model_dir: Path) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["happy", "sad"]}},
              "required": ["ok", "mood"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    async with open_engine(random_model_dir, warmup=False, prompt_lookup=4, spec_max_batch=2) as engine:
        results: dict[str, dict] = {}

        async def structured() -> None:
            r = req("json please", response_format=rf, max_tokens=60, enable_thinking=False)
            async with engine.stream(r) as s:
                assert not s.grammar_downgraded
                results["json"] = await s.collect()

        async def free() -> None:
            results["free"] = await engine.complete(req(PROMPTS[0], max_tokens=60))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(structured)
            nursery.start_soon(free)
        out = json.loads(results["json"]["choices"][0]["message"]["content"])
        assert set(out) == {"ok", "mood"} and out["mood"] in ("happy", "sad")
        assert engine.statistics().spec_steps > 0


async def test_profile_reports_the_request_s_speculation(echo_all_dir: Path) -> None:
    async with open_engine(echo_all_dir, warmup=False, prompt_lookup=4) as engine:
        async with engine.stream(req("la la la la la la la la", max_tokens=40), profile="basic") as s:
            events = [e async for e in s]
        prof = next(e for e in events if isinstance(e, Profile)).payload
        assert prof["spec_proposed"] > 0 and 0 < prof["spec_accepted"] <= prof["spec_proposed"]
    async with open_engine(echo_all_dir, warmup=False) as engine:
        async with engine.stream(req("la la la la", max_tokens=10), profile="basic") as s:
            events = [e async for e in s]
        prof = next(e for e in events if isinstance(e, Profile)).payload
        assert "spec_proposed" not in prof


async def test_prompt_lookup_is_automatic_by_the_model_s_weights(echo_all_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """By default (``prompt_lookup`` None) a model below
    ``AUTO_LOOKUP_MIN_BYTES`` of weights decodes plainly; one at or above it
    speculates with the kernel set's tokens per step (logged); an explicit 0 is off
    whatever the size."""
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, _ = load(str(echo_all_dir))
    size = speculative.weight_bytes(model)
    assert 0 < size < speculative.AUTO_LOOKUP_MIN_BYTES
    assert size == sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))
    assert speculative.auto_lookup_tokens(model) == 0
    tokens = speculative.auto_lookup_tokens(model, min_bytes=size)
    assert tokens == speculative.auto_lookup_tokens(model, min_bytes=size, isa=qmatmul.kernel_isa())

    async def proposed(**config: object) -> int:
        async with open_engine(echo_all_dir, warmup=False, **config) as engine:
            async with engine.stream(req("la la la la la la la la", max_tokens=24), profile="basic") as s:
                events = [e async for e in s]
            return next(e for e in events if isinstance(e, Profile)).payload.get("spec_proposed", 0)

    assert await proposed() == 0
    monkeypatch.setattr(speculative, "AUTO_LOOKUP_MIN_BYTES", size)
    caplog.set_level(logging.INFO, logger="afm.engine")
    assert await proposed() > 0
    assert f"prompt lookup: {tokens} tokens per step (automatic" in caplog.text
    assert await proposed(prompt_lookup=0) == 0


@pytest.mark.parametrize(("isa", "tokens"), [("avx512-vnni", speculative.AUTO_LOOKUP_TOKENS_VNNI),
                                             ("avx2-vnni", speculative.AUTO_LOOKUP_TOKENS_VNNI),
                                             ("avx2", speculative.AUTO_LOOKUP_TOKENS),
                                             ("scalar", speculative.AUTO_LOOKUP_TOKENS),
                                             (None, speculative.AUTO_LOOKUP_TOKENS)])
def test_automatic_lookup_proposes_by_the_kernel_set(echo_all_dir: Path, isa: str | None, tokens: int) -> None:
    """On by default, prompt lookup proposes 4 tokens a step with the VNNI
    kernels (a verify pass over 5 positions costs little more than a step)
    and 2 with the others (AVX2's integer products of 5 rows cost about two
    steps; no kernels: MLX's products), and none below the weights' floor."""
    from mlx_lm import load

    model, _ = load(str(echo_all_dir))
    assert (speculative.AUTO_LOOKUP_TOKENS_VNNI, speculative.AUTO_LOOKUP_TOKENS) == (4, 2)
    assert speculative.auto_lookup_tokens(model, min_bytes=0, isa=isa) == tokens
    assert speculative.auto_lookup_tokens(model, isa=isa) == 0


_EXT = qmatmul.extension()


@pytest.mark.parametrize("isa", _EXT.available_isas() if _EXT is not None else [], indirect=True)
def test_automatic_lookup_follows_the_kernels_in_use(echo_all_dir: Path, isa: str) -> None:
    """The kernel set in use decides, for each set this CPU runs
    (``AFM_QMM_ISA`` forcing AVX2 on an AVX-512 machine proposes what an
    AVX2 machine does)."""
    from mlx_lm import load

    model, _ = load(str(echo_all_dir))
    assert qmatmul.kernel_isa() == isa
    assert speculative.auto_lookup_tokens(model, min_bytes=0) == (4 if "vnni" in isa else 2)


async def test_automatic_lookup_leaves_seeded_rows_alone(echo_all_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default (not asked for), prompt lookup leaves sampled rows with a
    ``seed`` out, so a seed gives the tokens it gives without speculation,
    while greedy rows speculate; asked for (``prompt_lookup=4``), seeded rows
    speculate too."""
    monkeypatch.setattr(speculative, "AUTO_LOOKUP_MIN_BYTES", 0)
    text = "la la la la la la la la la la"

    async def proposed(engine: Engine, r: ChatRequest) -> tuple[str, int]:
        async with engine.stream(r, profile="basic") as s:
            events = [e async for e in s]
        out = "".join(getattr(e, "text", "") or "" for e in events)
        return out, next(e for e in events if isinstance(e, Profile)).payload.get("spec_proposed", 0)

    async def run(**config: object) -> tuple[tuple[str, int], int]:
        async with open_engine(echo_all_dir, warmup=False, **config) as engine:
            seeded = await proposed(engine, req(text, max_tokens=30, temperature=0.9, seed=11))
            _, greedy = await proposed(engine, req(text, max_tokens=30))
            return seeded, greedy

    (plain, _), (auto, auto_greedy), (asked, _) = await run(spec_max_batch=0), await run(), \
        await run(prompt_lookup=4)
    assert plain[0] and auto == (plain[0], 0)
    assert auto_greedy > 0 and asked[1] > 0


def test_config_rejects_bad_settings() -> None:
    from afm_core._engine.config import DistributedConfig, EngineConfig

    with pytest.raises(ValueError):
        EngineConfig(prompt_lookup=-1)
    with pytest.raises(ValueError):
        EngineConfig(draft_tokens=0)
    with pytest.raises(ValueError):
        EngineConfig(prompt_lookup=4, spec_max_batch=1, distributed=DistributedConfig())
    # combined with adapters and a quantized cache (see test_speculative_combined.py)
    EngineConfig(prompt_lookup=4, kv_bits=8)
    EngineConfig(distributed=DistributedConfig())  # automatic lookup: off when distributed
    EngineConfig(draft_model="d", adapters=(("a", "/x"),))


async def test_a_model_with_last_position_logits_only_decodes_plainly(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir, warmup=False, prompt_lookup=4) as engine:
        r = await engine.complete(req("la la la la la la la la", max_tokens=30))
        assert r["choices"][0]["message"]["content"] == "la la la la la la la la"
        assert engine.statistics().spec_steps == 0


async def test_logprobs_and_seeded_streams_beside_a_speculating_one(random_model_dir: Path) -> None:
    """A row that does not speculate (logprobs) rides in the verify pass at
    its position 0 and gets what a plain step gives it; a seeded sampled row
    speculates too: other tokens than without speculation (other draws), the
    same ones again for the same seed."""
    others = [req(PROMPTS[1], max_tokens=20, logprobs=True, top_logprobs=2),
              req(PROMPTS[2], max_tokens=20, temperature=0.8, seed=5)]

    async def run(engine: Engine) -> list[dict]:
        results: list[dict] = [{}, {}, {}]

        async def one(i: int, r: ChatRequest) -> None:
            results[i] = await engine.complete(r)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0, req(PROMPTS[0], max_tokens=40))
            for i, r in enumerate(others, 1):
                nursery.start_soon(one, i, r)
        return [{k: v for k, v in r.items() if k not in ("id", "created")} for r in results]

    async with open_engine(random_model_dir, warmup=False, spec_max_batch=0) as engine:
        plain = await run(engine)
    async with open_engine(random_model_dir, warmup=False, spec_max_batch=3, prompt_lookup=3) as engine:
        spec = await run(engine)
        assert engine.statistics().spec_steps > 0
        again = await run(engine)
    assert [r["choices"][0]["message"] for r in spec[:2]] == [r["choices"][0]["message"] for r in plain[:2]]
    assert spec[2]["choices"][0]["message"] == again[2]["choices"][0]["message"]
    # the verify pass computes position 0 with other kernels: the same tokens, logprobs to float rounding
    got, want = spec[1]["choices"][0]["logprobs"]["content"], plain[1]["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in got] == [t["token"] for t in want] and len(got) == 20
    assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in want], abs=1e-4)
    assert [[x["token"] for x in t["top_logprobs"]] for t in got] == \
        [[x["token"] for x in t["top_logprobs"]] for t in want]


def test_sliding_window_layers_are_named_as_untrimmable(echo_all_dir: Path) -> None:
    from mlx_lm import load
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6,
                                 intermediate_size=128, num_attention_heads=2, head_dim=32, rms_norm_eps=1e-6,
                                 vocab_size=100, num_key_value_heads=1, sliding_window=4, sliding_window_pattern=6)
    assert speculative.untrimmable_layers(gemma3_text.Model(args)) == ["RotatingKVCache"]
    assert speculative.untrimmable_layers(load(str(echo_all_dir))[0]) == []


async def test_a_model_that_cannot_trim_its_cache_decodes_plainly_and_says_so(
        echo_all_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Asked for (``prompt_lookup=4``) on a model with sliding-window layers
    (Gemma 3's), speculation stays off with a warning naming the layers,
    instead of silently never verifying."""
    monkeypatch.setattr(speculative, "untrimmable_layers", lambda model: ["RotatingKVCache"])
    caplog.set_level(logging.INFO, logger="afm.engine")
    async with open_engine(echo_all_dir, warmup=False, prompt_lookup=4) as engine:
        async with engine.stream(req("la la la la la la la la", max_tokens=24), profile="basic") as s:
            events = [e async for e in s]
    assert next(e for e in events if isinstance(e, Profile)).payload.get("spec_proposed", 0) == 0
    warned = [r for r in caplog.records if "speculative decoding off" in r.getMessage()]
    assert warned and warned[0].levelno == logging.WARNING and "RotatingKVCache" in warned[0].getMessage()
