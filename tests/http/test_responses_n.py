"""``n`` > 1 on ``POST /v1/responses`` (afm's extension) end to end: a real
hypercorn server on 127.0.0.1 with the echo model (and the tiny random model),
driven by the official openai SDK (``extra_body={"n": N}``) and httpx.

Each choice is its own engine stream (one group, one prefill); its output items
carry ``choice_index``; a stream's items interleave, ``output_index`` counting
them in the order they are added; usage counts the prompt once; one cancel
ends every choice; a stored response with choices is not continued."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from afm_http.testing import running_server
from tests.http.test_responses import CALL, RESPONSES, TOOLS, raw_events, sdk, wait_idle

N = 3


def choice_of(item: Any) -> int:
    """An SDK output item's ``choice_index`` (an extra field the SDK keeps)."""
    extra = item.model_extra if hasattr(item, "model_extra") else item
    return int(extra["choice_index"])


def check_indices(events: list[Any]) -> dict[int, int]:
    """The stream's ``output_index`` values are dense, in the order the items were
    added, and every item event names an added index; output_index -> choice."""
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == list(range(len(added)))
    owner = {e.output_index: choice_of(e.item) for e in added}
    for e in events:
        if hasattr(e, "output_index"):
            assert e.output_index in owner, e
    return owner


def assert_envelope(r: httpx.Response, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param, err
    return err


# -- create ------------------------------------------------------------------------


async def test_non_streaming_n_choices_and_the_store(echo_model_dir: Path) -> None:
    text = "three answers, one prompt"
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        client = sdk(url)
        one = await client.responses.create(model="m", input=text)
        resp = await client.responses.create(model="m", input=text, extra_body={"n": N})
        assert resp.status == "completed" and resp.model_extra["n"] == N
        assert [(o.type, choice_of(o)) for o in resp.output] == [("message", i) for i in range(N)]
        assert [o.content[0].text for o in resp.output] == [text] * N  # type: ignore[union-attr]
        assert len({o.id for o in resp.output}) == N and all(o.status == "completed" for o in resp.output)
        u, u1 = resp.usage, one.usage
        assert u is not None and u1 is not None
        assert u.input_tokens == u1.input_tokens  # the prompt once
        assert u.output_tokens == N * u1.output_tokens  # every choice's output
        assert u.total_tokens == u.input_tokens + u.output_tokens
        assert u.output_tokens_details.reasoning_tokens == 0
        # the store keeps the whole response
        got = await client.responses.retrieve(resp.id)
        assert [choice_of(o) for o in got.output] == list(range(N)) and got.usage == resp.usage
        # ... but does not guess which choice a continuation goes on from
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m", input="next", previous_response_id=resp.id)
        err = e.value.body
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
        assert err["param"] == "previous_response_id" and err["code"] == "previous_response_has_choices"
        assert "cannot be inferred" in err["message"] and resp.id in err["message"]
        # the client continues with the items of the choice it picked
        picked = [o.model_dump(exclude_none=True) for o in resp.output if choice_of(o) == 1]
        follow = await client.responses.create(model="m", input=[  # type: ignore[arg-type]
            {"role": "user", "content": text}, *picked, {"role": "user", "content": "go on"}])
        assert follow.output_text == "go on"
        # n=1 spelled out is the plain response: no choice_index, no n echoed
        plain = (await c.post(RESPONSES, json={"input": text, "n": 1})).json()
        assert "n" not in plain and "choice_index" not in plain["output"][0]
        await wait_idle(engine)
        await client.close()


async def test_streaming_interleaves_choices_with_dense_output_indices(echo_model_dir: Path) -> None:
    text = " ".join(f"word{i}" for i in range(150))  # long enough for the engine not to finish
    # both choices before the reader reads (a reader that falls behind gets each choice's
    # events in one batch, one choice after the other)
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        client = sdk(url)
        stream = await client.responses.create(model="m", input=text, stream=True, extra_body={"n": 2})
        events = [e async for e in stream]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        owner = check_indices(events)
        assert sorted(owner.values()) == [0, 1]
        parts: dict[int, str] = defaultdict(str)
        order = []
        for e in events:
            if e.type == "response.output_text.delta":
                parts[owner[e.output_index]] += e.delta
                order.append(owner[e.output_index])
        assert dict(parts) == {0: text, 1: text}
        assert order != sorted(order), ("the choices' deltas interleave", order)
        last = events[-1]
        assert last.type == "response.completed" and last.response.status == "completed"
        # streamed: the final output is in output_index order
        assert [o.id for o in last.response.output] == [e.item.id for e in events
                                                        if e.type == "response.output_item.added"]
        assert last.response.usage is not None
        one = await client.responses.create(model="m", input=text)
        assert one.usage is not None
        assert last.response.usage.output_tokens == 2 * one.usage.output_tokens
        assert last.response.usage.input_tokens == one.usage.input_tokens

        # the SDK's stream helper accumulates the same and its final response parses
        async with client.responses.stream(model="m", input=text, extra_body={"n": 2}) as s:
            helper = [e async for e in s]
            final = await s.get_final_response()
        check_indices(helper)
        assert final.status == "completed" and len(final.output) == 2
        texts = {choice_of(o): o.content[0].text for o in final.output}  # type: ignore[union-attr]
        assert texts == {0: text, 1: text}

        # the raw framing: each frame's event name and data agree
        r, raw = await raw_events(c, {"input": text, "n": 2}, {"X-Request-ID": "resp-n-raw"})
        assert r.headers["x-request-id"] == "resp-n-raw" and raw[-1]["type"] == "response.completed"
        assert raw[-1]["response"]["n"] == 2
        await wait_idle(engine)
        await client.close()


async def test_function_calls_per_choice_stream_their_arguments(echo_model_dir: Path) -> None:
    said = "Checking." + CALL
    async with running_server(echo_model_dir) as (url, engine):
        client = sdk(url)
        args: dict[int, list[str]] = defaultdict(list)
        async with client.responses.stream(model="m", input=said, tools=TOOLS, extra_body={"n": 2}) as s:
            events = [e async for e in s]
            final = await s.get_final_response()
        owner = check_indices(events)
        for e in events:
            if e.type == "response.function_call_arguments.delta":
                args[owner[e.output_index]].append(e.delta)
        # each choice's arguments stream fragment by fragment, not at once at the end
        assert set(args) == {0, 1} and all(len(a) > 1 for a in args.values())
        assert [json.loads("".join(args[i])) for i in (0, 1)] == [{"city": "Paris"}] * 2
        assert final.status == "completed"
        calls = [o for o in final.output if o.type == "function_call"]
        assert sorted(choice_of(o) for o in calls) == [0, 1]
        assert all(o.name == "get_weather" and json.loads(o.arguments) == {"city": "Paris"} for o in calls)  # type: ignore[union-attr]
        assert len({o.call_id for o in calls}) == 2  # type: ignore[union-attr]
        messages = [o for o in final.output if o.type == "message"]
        assert [o.content[0].text for o in messages] == ["Checking."] * 2  # type: ignore[union-attr]
        # not streamed: grouped by choice, a message then a call each
        resp = await client.responses.create(model="m", input=said, tools=TOOLS, extra_body={"n": 2})
        assert [(o.type, choice_of(o)) for o in resp.output] == [
            ("message", 0), ("function_call", 0), ("message", 1), ("function_call", 1)]
        await wait_idle(engine)
        await client.close()


async def test_greedy_choices_equal_the_single_answer(random_model_dir: Path) -> None:
    async with running_server(random_model_dir) as (url, _):
        client = sdk(url)
        kw: dict[str, Any] = {"model": "m", "input": "tell me something", "temperature": 0,
                              "max_output_tokens": 8}
        one = await client.responses.create(**kw)
        many = await client.responses.create(**kw, extra_body={"n": N})
        assert [choice_of(o) for o in many.output] == sorted(choice_of(o) for o in many.output)
        by_choice: dict[int, list[str]] = defaultdict(list)
        for o in many.output:
            by_choice[choice_of(o)].append(o.type)
        assert set(by_choice) == set(range(N))
        assert all(kinds == [o.type for o in one.output] for kinds in by_choice.values())
        assert many.status == one.status  # "incomplete" at max_output_tokens for every choice, or not
        if one.status == "incomplete":
            assert many.incomplete_details is not None and many.incomplete_details.reason == "max_output_tokens"
        assert many.usage is not None and one.usage is not None
        assert many.usage.output_tokens == N * one.usage.output_tokens
        assert many.usage.input_tokens == one.usage.input_tokens
        stream = await client.responses.create(**kw, stream=True, extra_body={"n": N})
        events = [e async for e in stream]
        check_indices(events)
        assert events[-1].response.status == one.status
        await client.close()


async def test_reasoning_per_choice_counts_its_tokens(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        said = "<think>step by step</think>Final."
        one = await client.responses.create(model="m", input=said)
        many = await client.responses.create(model="m", input=said, extra_body={"n": 2})
        assert [(o.type, choice_of(o)) for o in many.output] == [
            ("reasoning", 0), ("message", 0), ("reasoning", 1), ("message", 1)]
        assert one.usage is not None and many.usage is not None
        assert many.usage.output_tokens_details.reasoning_tokens \
            == 2 * one.usage.output_tokens_details.reasoning_tokens > 0
        await client.close()


# -- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 17, -1, "x", 1.5, True, [2]])
async def test_bad_n_is_a_400_envelope(echo_model_dir: Path, n: Any) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        for stream in (False, True):
            assert_envelope(await c.post(RESPONSES, json={"input": "x", "n": n, "stream": stream}), "n")
        client = sdk(url)
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m", input="x", extra_body={"n": n})
        assert e.value.status_code == 400 and e.value.body["param"] == "n"  # type: ignore[index]
        await client.close()
        assert engine.statistics().requests_active == 0


async def test_more_choices_than_the_engine_takes(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir, max_batch=2, max_waiting=2) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        err = assert_envelope(await c.post(RESPONSES, json={"input": "x", "n": 5}), "n")
        assert "at most 4" in err["message"]
        r = await c.post(RESPONSES, json={"input": "four", "n": 4})
        assert [o["choice_index"] for o in r.json()["output"]] == [0, 1, 2, 3]


# -- cancel ------------------------------------------------------------------------


async def test_cancel_by_response_id_ends_every_choice(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        client = sdk(url)
        events: list[Any] = []
        cancelled: dict[str, Any] = {}
        stream = await client.responses.create(model="m", input="word " * 3000, stream=True,
                                               extra_body={"n": N})

        async def cancel_when_streaming(resp_id: str) -> None:
            with trio.fail_after(20):
                while len({e.output_index for e in events if e.type == "response.output_text.delta"}) < N \
                        or len(events) < 20:
                    await trio.sleep(0.01)
            cancelled["response"] = await client.responses.cancel(resp_id)

        async with trio.open_nursery() as nursery:
            async for event in stream:
                events.append(event)
                if event.type == "response.created":
                    nursery.start_soon(cancel_when_streaming, event.response.id)
        final = events[-1]
        assert final.type == "response.incomplete" and final.response.status == "cancelled"
        assert sum(e.type in ("response.completed", "response.incomplete") for e in events) == 1
        assert sorted(choice_of(o) for o in final.response.output) == list(range(N))
        assert all(o.status == "incomplete" for o in final.response.output)
        assert cancelled["response"].status == "cancelled"
        stats = await wait_idle(engine)
        assert stats.finished.get("cancelled") == N
        assert stats.generation_tokens < N * 3000
        stored = await client.responses.retrieve(final.response.id)
        assert stored.status == "cancelled" and stored.usage is not None
        assert stored.usage.output_tokens == stats.generation_tokens
        await client.close()


async def test_cancel_by_request_id_and_disconnect_end_every_choice(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        client = sdk(url)
        got: dict[str, Any] = {}

        async def create() -> None:
            got["response"] = await client.responses.create(
                model="m", input="word " * 3000, extra_body={"n": N},
                extra_headers={"X-Request-ID": "resp-n-cancel"})

        async with trio.open_nursery() as nursery:  # not streamed: the answer comes at the end
            nursery.start_soon(create)
            with trio.fail_after(20):
                while engine.statistics().generation_tokens < 10 * N:
                    await trio.sleep(0.01)
            r = await c.post("/v1/chat/completions/resp-n-cancel/cancel")
            assert r.status_code == 200 and r.json()["cancelled"] is True
        resp = got["response"]
        assert resp.status == "cancelled" and [choice_of(o) for o in resp.output] == list(range(N))
        stats = await wait_idle(engine)
        assert stats.finished.get("cancelled") == N and stats.generation_tokens < N * 3000

        # a client that leaves drops every choice
        async with c.stream("POST", RESPONSES, json={"input": "word " * 3000, "stream": True, "n": N}) as r:
            lines = 0
            async for _ in r.aiter_lines():
                lines += 1
                if lines > 60:
                    break
        abandoned = await wait_idle(engine)
        assert abandoned.generation_tokens - stats.generation_tokens < 3000  # no choice ran to its end
        # none is still decoding: while a probe runs, its tokens are all the engine generates
        probe = await client.responses.create(model="m", input="probe " * 20)
        after = engine.statistics()
        assert probe.usage is not None
        assert after.generation_tokens - abandoned.generation_tokens == probe.usage.output_tokens > 0
        await client.close()


async def test_progress_is_the_first_choices(random_model_dir: Path) -> None:
    prompt = " ".join(f"word{i}" for i in range(60))
    async with running_server(random_model_dir, prefill_step=16, prefix_cache_bytes=0,
                              warmup=False) as (url, _):
        client = sdk(url)
        async with client.responses.stream(model="m", input=prompt, max_output_tokens=4, temperature=0,
                                           extra_body={"n": 2}, extra_headers={"X-AFM-Progress": "true"}) as s:
            events = [e async for e in s]
        progress = [e.model_extra["prompt_progress"] for e in events if e.type == "response.prompt_progress"]
        assert len(progress) >= 3 and progress[-1]["processed"] == progress[-1]["total"]
        assert len({p["total"] for p in progress}) == 1  # one prompt's (choice 0's)
        kinds = [e.type for e in events]
        assert kinds.index("response.prompt_progress") < kinds.index("response.output_item.added")
        check_indices(events)
        final = events[-1].response
        assert final.usage is not None and final.usage.input_tokens == progress[-1]["total"]
        await client.close()
