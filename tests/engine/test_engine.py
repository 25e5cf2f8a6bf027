"""The Trio engine on the echo and random tiny models."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path

import pytest
import trio

from afm_core._engine.commands import RequestState
from afm_core._engine.engine import Engine, EngineStatistics, open_engine
from afm_core._errors import (
    ContextLengthError,
    DuplicateRequestError,
    EngineBusyError,
    EngineClosedError,
    RequestError,
    UnsupportedError,
)
from afm_core._mlx.blas import blas_info
from afm_core._stream.events import (
    ContentDelta,
    Finish,
    LogprobsDelta,
    Profile,
    ReasoningDelta,
    Usage,
)
from afm_core.api.chat_request import ChatRequest


def req(text: str, **kw) -> ChatRequest:
    return ChatRequest.from_openai({"messages": [{"role": "user", "content": text}], **kw})


async def collect(engine: Engine, r: ChatRequest, **kw) -> list:
    async with engine.stream(r, **kw) as s:
        return [e async for e in s]


def content(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


async def wait_for(pred, limit: float = 10.0) -> None:
    with trio.fail_after(limit):
        while not pred():
            await trio.sleep(0.005)


async def settled(engine: Engine) -> EngineStatistics:
    """The statistics once the generation thread has applied every command
    sent so far and run the step that follows (``Worker.sync``).  A thread
    holding no job then waits for the next command: nothing more is generated
    until one comes, so equal ``steps`` before and after prove it idle."""
    worker = engine._worker
    assert worker is not None
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()
    worker.sync(lambda: token.run_sync_soon(done.set))
    with trio.fail_after(10):
        await done.wait()
    return engine.statistics()


async def test_echo_stream_lifecycle(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        text = "Hello, wörld! 東京 🚀"
        events = await collect(engine, req(text))
        assert content(events) == text
        assert events[-2] == Finish("stop")
        usage = events[-1]
        assert isinstance(usage, Usage)
        assert usage.completion_tokens == len(engine._tokenizer.encode(text, add_special_tokens=False)) + 1
        assert engine.statistics().running == 0


async def test_complete_matches_stream(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        c = await engine.complete(req("non-streaming works"))
        assert c["object"] == "chat.completion"
        assert c["choices"][0]["message"]["content"] == "non-streaming works"
        assert c["choices"][0]["finish_reason"] == "stop"
        assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]


async def test_tokenize_chat_counts_what_the_stream_reports(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        body = {"messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "count these tokens"}]}
        ids = await engine.tokenize_chat(body)
        assert ids and all(isinstance(i, int) for i in ids)
        async with engine.stream(body) as s:
            assert s.prompt_tokens == len(ids)
        assert await engine.tokenize_chat(ChatRequest.from_openai(body)) == ids
        with pytest.raises(RequestError):
            await engine.tokenize_chat({"messages": []})
    with pytest.raises(EngineClosedError):
        await engine.tokenize_chat(body)


async def test_a_dict_request_is_validated_like_the_http_layer_s(echo_model_dir: Path) -> None:
    body = {"messages": [{"role": "user", "content": "plain dict, same stream"}], "max_tokens": 40,
            "temperature": 0}
    # no prefix cache: the second run would otherwise report cached tokens in its usage
    async with open_engine(echo_model_dir, prefix_cache_bytes=0) as engine:
        from_dict = await collect(engine, body)
        from_request = await collect(engine, ChatRequest.from_openai(body))
        assert from_dict == from_request
        assert content(from_dict) == "plain dict, same stream"
        c = await engine.complete(dict(body))
        assert c["choices"][0]["message"]["content"] == "plain dict, same stream"
        # a bad body is the usual request error, raised when the stream is asked for
        for bad in ({"messages": "not a list"}, {"messages": []},
                    {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}):
            with pytest.raises(RequestError) as info:
                engine.stream(bad)
            assert info.value.status == 400
            with pytest.raises(RequestError):
                await engine.complete(bad)
        # anything else is a programming error, raised at the call
        for wrong in (42, None, [("role", "user")], '{"messages": []}'):
            with pytest.raises(TypeError, match="ChatRequest or an OpenAI-style dict"):
                engine.stream(wrong)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="ChatRequest or an OpenAI-style dict"):
                await engine.complete(wrong)  # type: ignore[arg-type]
        assert engine.statistics().requests_active == 0
        assert (await engine.complete(req("still serving")))["choices"][0]["message"]["content"] == "still serving"


async def test_nursery_start(echo_model_dir: Path) -> None:
    engine = Engine(echo_model_dir)
    async with trio.open_nursery() as nursery:
        started = await nursery.start(engine.run)
        assert started is engine
        assert (await engine.complete(req("x")))["choices"][0]["message"]["content"] == "x"
        nursery.cancel_scope.cancel()


async def test_concurrent_streams_differ_in_length_and_params(echo_model_dir: Path) -> None:
    texts = [f"stream {i} " + "word " * (i * 7) for i in range(10)]
    results: dict[int, list] = {}
    async with open_engine(echo_model_dir, max_batch=8) as engine:
        async def one(i: int) -> None:
            kw = {"temperature": 0.7, "top_p": 0.9, "seed": i} if i % 2 else {"temperature": 0}
            results[i] = await collect(engine, req(texts[i], **kw))

        async with trio.open_nursery() as n:
            for i in range(len(texts)):
                n.start_soon(one, i)
        for i, events in results.items():
            assert content(events) == texts[i]
            assert Finish("stop") in events
        assert engine.statistics().running == 0


async def test_length_finish(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        events = await collect(engine, req("one two three four five six", max_tokens=3))
        assert Finish("length") in events
        assert events[-1].completion_tokens == 3
        assert len(content(events)) > 0


async def test_stop_string_straddling_tokens(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        text = "keep this part<<STOP>>but not this"
        ids = engine._tokenizer.encode("<<STOP>>", add_special_tokens=False)
        assert len(ids) > 1  # the stop string spans several tokens
        events = await collect(engine, req(text, stop=["<<STOP>>", "never"]))
        assert content(events) == "keep this part"
        assert Finish("stop") in events
        # generation really stopped: fewer tokens than the full echo
        full = len(engine._tokenizer.encode(text, add_special_tokens=False))
        assert events[-1].completion_tokens < full
        # a stop string at the very start: an empty answer is "" (null is for tool calls only)
        c = await engine.complete(req("stop words here", stop=["s"]))
        assert c["choices"][0]["message"]["content"] == ""
        assert c["choices"][0]["finish_reason"] == "stop"


async def test_reasoning_is_split(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        events = await collect(engine, req("<think>let me see</think>The answer."))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        assert reasoning == "let me see"
        assert content(events) == "The answer."
        off = await collect(engine, req("<think>x</think>y", enable_thinking=False))
        assert content(off) == "<think>x</think>y"


async def test_cancel_by_id_frees_slot_and_spares_others(echo_model_dir: Path) -> None:
    long_text = "token " * 3000
    async with open_engine(echo_model_dir) as engine:
        got: list = []
        other: list = []

        async def victim() -> None:
            async with engine.stream(req(long_text), request_id="victim") as s:
                async for e in s:
                    got.append(e)

        async def bystander() -> None:
            other.extend(await collect(engine, req("bystander " * 50)))

        async with trio.open_nursery() as n:
            n.start_soon(victim)
            n.start_soon(bystander)
            await wait_for(lambda: sum(isinstance(e, ContentDelta) for e in got) >= 5)
            assert engine.cancel("victim") is True
        assert Finish("cancelled") in got
        assert got[-1].completion_tokens < 3000
        assert content(other) == "bystander " * 50
        assert engine.cancel("victim") is False  # no longer in flight
        stats = await settled(engine)
        assert stats.running == 0 and stats.requests_active == 0
        assert (await settled(engine)).steps == stats.steps  # nothing more is generated


async def test_trio_cancellation_frees_slot(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        seen = 0
        with trio.CancelScope() as scope:  # the reader's own scope, cancelled mid-stream
            async with engine.stream(req("token " * 5000)) as s:
                async for e in s:
                    seen += isinstance(e, ContentDelta)
                    if seen >= 5:
                        scope.cancel()
        assert scope.cancelled_caught and 5 <= seen < 5000
        stats = await settled(engine)  # the stream's Drop is applied
        assert stats.running == 0 and stats.requests_active == 0
        assert (await settled(engine)).steps == stats.steps  # nothing more is generated
        c = await engine.complete(req("still serving"))
        assert c["choices"][0]["message"]["content"] == "still serving"


async def test_cancel_non_streaming_and_queued(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir, max_batch=1, max_waiting=4) as engine:
        results: dict[str, dict] = {}

        async def run(rid: str, text: str) -> None:
            results[rid] = await engine.complete(req(text), request_id=rid)

        async with trio.open_nursery() as n:
            n.start_soon(run, "first", "token " * 2000)
            await wait_for(lambda: engine.statistics().running == 1)
            n.start_soon(run, "queued", "never runs " * 10)
            await wait_for(lambda: "queued" in engine._inflight
                           and engine._inflight["queued"].state is RequestState.SUBMITTED)
            assert engine.cancel("queued")
            assert engine.cancel("first")
        assert results["first"]["choices"][0]["finish_reason"] == "cancelled"
        assert results["queued"]["choices"][0]["finish_reason"] == "cancelled"
        assert results["queued"]["usage"]["completion_tokens"] == 0
        assert engine.statistics().running == 0


async def test_busy_and_duplicate_ids(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir, max_batch=1, max_waiting=0) as engine:
        async with engine.stream(req("token " * 500), request_id="a") as s:
            with pytest.raises(DuplicateRequestError):
                async with engine.stream(req("x"), request_id="a"):
                    pass
            with pytest.raises(EngineBusyError) as info:
                async with engine.stream(req("x"), request_id="b"):
                    pass
            assert info.value.status == 503
            engine.cancel("a")
            assert Finish("cancelled") in [e async for e in s]
        assert (await engine.complete(req("ok")))["choices"][0]["message"]["content"] == "ok"


async def test_context_overflow_rejected(tmp_path: Path) -> None:
    from afm_core.testing import make_echo_model

    d = make_echo_model(tmp_path / "small", context_length=64)
    async with open_engine(d) as engine:
        with pytest.raises(ContextLengthError) as info:
            await engine.complete(req("word " * 100))
        assert info.value.status == 400 and info.value.code == "context_length_exceeded"
        with pytest.raises(ContextLengthError):
            await engine.complete(req("short", max_tokens=60))
        # the rest of the context is the default budget
        c = await engine.complete(req("short"))
        assert c["choices"][0]["message"]["content"] == "short"


async def test_prefix_cache_hits(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        history = [{"role": "user", "content": "a fairly long first message " * 10}]
        first = await engine.complete(ChatRequest.from_openai({"messages": history}))
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        history += [first["choices"][0]["message"], {"role": "user", "content": "and a follow-up"}]
        second = await engine.complete(ChatRequest.from_openai({"messages": history}))
        assert second["choices"][0]["message"]["content"] == "and a follow-up"
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"]
        assert engine.statistics().prefix_cache_hits >= 1
    async with open_engine(echo_model_dir, prefix_cache_bytes=0) as engine:
        await engine.complete(req("same"))
        again = await engine.complete(req("same"))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_logprobs_stream_and_complete(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        events = await collect(engine, req("abc def", logprobs=True, top_logprobs=3))
        lps = [e for e in events if isinstance(e, LogprobsDelta)]
        assert lps
        for lp in lps:
            entry = lp.content[0]
            assert entry.logprob == pytest.approx(0.0, abs=1e-6)
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].token == entry.token
        c = await engine.complete(req("abc def", logprobs=True, top_logprobs=2))
        tokens = c["choices"][0]["logprobs"]["content"]
        assert "".join(t["token"] for t in tokens) == "abc def"


async def test_profiles(echo_model_dir: Path) -> None:
    async with open_engine(echo_model_dir) as engine:
        events = await collect(engine, req("profile me " * 5), profile="basic")
        prof = [e for e in events if isinstance(e, Profile)]
        assert len(prof) == 1 and not prof[0].extended and events[-1] is prof[0]
        p = prof[0].payload
        for key in ("prefill_tok_s", "decode_tok_s", "memory_weights_gib", "memory_kv_gib",
                    "memory_peak_gib", "chip"):
            assert key in p
        assert p["decode_tok_s"] > 0
        assert 0 <= p["queue_s"] <= p["ttft_s"]
        assert not any(k.startswith("gpu") for k in p)
        # the BLAS under MLX, as the generation thread confirmed it at start
        assert p["blas"] == engine.statistics().blas == blas_info().name
        ext = await collect(engine, req("profile me " * 5), profile="extended")
        payload = ext[-1].payload
        assert ext[-1].extended and set(payload) == {"summary", "samples"}
        assert payload["samples"] and all("t" in s for s in payload["samples"])


async def test_random_model_sampling_and_seed(random_model_dir: Path) -> None:
    async with open_engine(random_model_dir) as engine:
        kw = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "min_p": 0.01, "seed": 1234,
              "max_tokens": 12, "presence_penalty": 0.5, "frequency_penalty": 0.3,
              "repetition_penalty": 1.1, "logit_bias": {"5": 2.0}}
        a = await engine.complete(req("hello", **kw))
        b = await engine.complete(req("hello", **kw))
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert a["usage"]["completion_tokens"] <= 12
        # logit_bias dominates: a huge bias on one token makes it the output
        tok = engine._tokenizer
        tid = tok.encode("Paris", add_special_tokens=False)[0]
        c = await engine.complete(req("hi", temperature=0, max_tokens=4, logit_bias={str(tid): 100}))
        assert c["choices"][0]["message"]["content"] == tok.decode([tid]) * 4


async def test_strict_schema_is_enforced(random_model_dir: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["happy", "sad"]}},
        "required": ["ok", "mood"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    async with open_engine(random_model_dir) as engine:
        for seed in range(3):
            r = req("json please", response_format=rf, temperature=1.0, seed=seed, max_tokens=40,
                    enable_thinking=False)
            async with engine.stream(r) as s:
                assert not s.grammar_downgraded
                c = await s.collect()
            out = json.loads(c["choices"][0]["message"]["content"])
            assert isinstance(out["ok"], bool) and out["mood"] in ("happy", "sad")
            assert set(out) == {"ok", "mood"}
            assert c["choices"][0]["finish_reason"] == "stop"
    async with open_engine(random_model_dir, grammar=False) as engine:
        async with engine.stream(req("x", response_format=rf, max_tokens=2)) as s:
            assert s.grammar_downgraded
            await s.collect()


async def test_pipeline_fault_fails_only_that_stream(echo_model_dir: Path, monkeypatch) -> None:
    import afm_core._engine.prepare as prepare
    from afm_core._stream.events import StreamFailure
    from afm_core._stream.pipeline import StreamPipeline

    class Faulty(StreamPipeline):  # the pipeline is a compiled class: subclass, don't patch
        seen = ""

        def feed_token(self, token_id, out):  # type: ignore[no-untyped-def]
            result = super().feed_token(token_id, out)
            self.seen += "".join(getattr(e, "text", "") for e in out)
            if "POISON" in self.seen:
                raise RuntimeError("injected pipeline fault")
            return result

    monkeypatch.setattr(prepare, "StreamPipeline", Faulty)
    async with open_engine(echo_model_dir) as engine:
        results: dict[str, list] = {}

        async def run(name: str, text: str) -> None:
            results[name] = await collect(engine, req(text))

        async with trio.open_nursery() as n:
            n.start_soon(run, "bad", "POISON and more text after it")
            n.start_soon(run, "good", "healthy neighbour " * 20)
        assert isinstance(results["bad"][-1], StreamFailure)
        assert "injected pipeline fault" in results["bad"][-1].message
        assert content(results["good"]) == "healthy neighbour " * 20
        assert engine.healthy
        monkeypatch.undo()
        c = await engine.complete(req("after the fault"))
        assert c["choices"][0]["message"]["content"] == "after the fault"
        assert engine.statistics().running == 0


async def test_tool_choice_required_and_named_are_enforced(random_model_dir: Path) -> None:
    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": n, "parameters": params}}
             for n in ("get_weather", "get_time")]
    async with open_engine(random_model_dir) as engine:
        for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}]):
            r = req("call something", tools=tools, tool_choice=choice, temperature=1.0, seed=seed,
                    max_tokens=80, parallel_tool_calls=False, enable_thinking=False)
            async with engine.stream(r) as s:
                assert not s.grammar_downgraded
                c = await s.collect()
            choice0 = c["choices"][0]
            assert choice0["finish_reason"] == "tool_calls", choice0
            calls = choice0["message"]["tool_calls"]
            assert len(calls) == 1
            assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Oslo")
            if isinstance(choice, dict):
                assert calls[0]["function"]["name"] == "get_time"
    async with open_engine(random_model_dir, grammar=False) as engine:
        async with engine.stream(req("x", tools=tools, tool_choice="required", max_tokens=2)) as s:
            assert s.grammar_downgraded
            await s.collect()


async def test_engine_recovers_after_a_failed_step(echo_model_dir: Path, monkeypatch) -> None:
    """A step that fails inside mlx-lm's sampler fails its batch, not the engine."""
    from mlx_lm.sample_utils import make_sampler

    from afm_core._engine.sampling import SamplerCache
    from afm_core._stream.events import StreamFailure

    original = SamplerCache.get

    def broken(self, r, vocab):  # type: ignore[no-untyped-def]
        if r.seed == 666:
            return make_sampler(temp=1.0, top_k=5000)  # top_k beyond the vocabulary: raises in MLX
        return original(self, r, vocab)

    monkeypatch.setattr(SamplerCache, "get", broken)
    async with open_engine(echo_model_dir) as engine:
        events = await collect(engine, req("doomed", temperature=1.0, seed=666, max_tokens=4))
        assert isinstance(events[-1], StreamFailure)
        for text in ("first after", "second after"):
            c = await engine.complete(req(text, temperature=0.5))
            assert c["choices"][0]["message"]["content"] == text
        assert engine.healthy


async def test_prefix_cache_memory_is_what_its_budget_counts(random_model_dir: Path) -> None:
    """Saved prefixes hold their own KV, not the whole batch buffer they came from."""
    import mlx.core as mx

    # (a budget for all 32: the default, sized to the tiny model's context, keeps fewer)
    async with open_engine(random_model_dir, max_batch=8, prefix_cache_bytes=1 << 30) as engine:
        worker = engine._worker
        assert worker is not None
        await engine.complete(req("warm up", max_tokens=2, temperature=0))
        base = mx.get_active_memory() - worker.prefix_cache.nbytes

        async def one(i: int) -> None:
            await engine.complete(req(f"prompt {i} " + "word " * (i % 7 * 5), max_tokens=8, temperature=0))

        async with trio.open_nursery() as n:
            for i in range(32):
                n.start_soon(one, i)
        held = mx.get_active_memory() - base
        counted = worker.prefix_cache.nbytes
        assert len(worker.prefix_cache) >= 32 and counted > 0
        # before the fix each entry kept its batch's buffer alive: ~9x what was counted
        assert held < 1.5 * counted + (1 << 20), (held, counted)


def generation_threads() -> int:
    return sum(t.name == "afm-generation" for t in threading.enumerate())


async def test_generation_threads_park_between_engines(echo_model_dir: Path) -> None:
    # a generation thread never ends (MLX's per-thread destructors need the
    # GIL, see afm_core._engine.genthread): closed engines' threads serve the next ones
    async with open_engine(echo_model_dir) as a, open_engine(echo_model_dir) as b:
        for engine in (a, b):
            assert content(await collect(engine, req("two engines", max_tokens=8))) == "two engines"
        pool = generation_threads()
        assert pool >= 2
    for _ in range(3):
        async with open_engine(echo_model_dir) as engine:
            assert content(await collect(engine, req("again", max_tokens=8))) == "again"
        assert generation_threads() == pool


async def test_warm_up_runs_before_start_and_leaves_no_trace(
        random_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="afm.engine")
    async with open_engine(random_model_dir) as engine:
        assert any("warmed up" in r.getMessage() for r in caplog.records)
        s = engine.statistics()
        assert (s.requests_total, s.prompt_tokens, s.generation_tokens, s.steps, s.ttft_count,
                s.prefix_cache_bytes, s.finished) == (0, 0, 0, 0, 0, 0, {})
        # the warm-up's prompt is not in the prefix cache: nothing is served from it
        done = await engine.complete(ChatRequest.from_openai(
            {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}))
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert engine.statistics().requests_total == 1
    caplog.clear()
    async with open_engine(random_model_dir, warmup=False) as engine:
        assert engine.statistics().requests_total == 0
    assert not any("warmed up" in r.getMessage() for r in caplog.records)


async def test_a_base_model_without_a_chat_template_warms_up_too(
        random_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    base = tmp_path / "base"
    shutil.copytree(random_model_dir, base)
    for name in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
        path = base / name
        if name == "tokenizer_config.json":
            config = json.loads(path.read_text())
            config.pop("chat_template", None)
            path.write_text(json.dumps(config))
        elif path.exists():
            path.unlink()
    caplog.set_level(logging.INFO, logger="afm.engine")
    async with open_engine(base) as engine:
        with pytest.raises(UnsupportedError, match="no chat template"):
            await engine.complete(ChatRequest.from_openai({"messages": [{"role": "user", "content": "Hi"}]}))
        assert engine.statistics().requests_total == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any("warmed up" in m for m in messages)
    assert not any("warm-up skipped" in m for m in messages)
