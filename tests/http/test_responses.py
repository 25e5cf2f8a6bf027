"""End-to-end OpenAI Responses: a real hypercorn server on 127.0.0.1 with the echo
model, driven by the official openai SDK (``client.responses.*``) and httpx.

The echo model answers with the last user turn, token for token: a
``<think>...</think>`` prefix becomes reasoning, a ``<tool_call>`` block a
function call, and a function call output (rendered as a user turn holding
``<tool_response>``) is echoed back as text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
import trio

from afm_http import ServerConfig
from afm_http.testing import running_server

RESPONSES = "/v1/responses"
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": False},
    {"type": "function", "name": "read_file", "parameters": {"type": "object"}, "strict": False},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def raw_events(c: httpx.AsyncClient, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """(response, events) of a streamed create; checks the ``event:``/``data:`` framing."""
    events: list[dict[str, Any]] = []
    async with c.stream("POST", RESPONSES, json={**body, "stream": True}, headers=headers or {}) as r:
        lines = [line async for line in r.aiter_lines()]
    assert r.status_code == 200, lines
    assert lines[-1] == "" and len(lines) % 3 == 0, lines[-4:]
    for name, data, blank in zip(lines[0::3], lines[1::3], lines[2::3], strict=True):
        assert name.startswith("event: ") and data.startswith("data: ") and blank == ""
        event = json.loads(data[6:])
        assert event["type"] == name[7:]
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return r, events


async def wait_idle(engine: Any) -> Any:
    with trio.fail_after(20):
        while (s := engine.statistics()).running or s.requests_active:
            await trio.sleep(0.01)
    return s


# -- create ------------------------------------------------------------------------


async def test_create_non_streaming_and_streaming(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        client = sdk(url)
        raw = await client.responses.with_raw_response.create(model="m", input="hello sdk",
                                                              metadata={"run": "1"})
        assert raw.headers["x-request-id"] and raw.headers["content-type"] == "application/json"
        resp = raw.parse()
        assert resp.output_text == "hello sdk"
        assert resp.id.startswith("resp_") and resp.object == "response" and resp.status == "completed"
        assert resp.model == "m" and resp.metadata == {"run": "1"} and resp.store is True
        (item,) = resp.output
        assert item.type == "message" and item.role == "assistant" and item.status == "completed"
        assert item.id.startswith("msg_")
        u = resp.usage
        assert u is not None and u.output_tokens > 0 and u.input_tokens > 0
        assert u.total_tokens == u.input_tokens + u.output_tokens
        assert u.output_tokens_details.reasoning_tokens == 0

        stream = await client.responses.create(model="m", input="streamed sdk", stream=True)
        events = [e async for e in stream]
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == "streamed sdk"
        assert len([e for e in events if e.type == "response.output_text.delta"]) > 1
        last = events[-1]
        assert last.type == "response.completed" and last.response.output_text == "streamed sdk"
        assert last.response.usage is not None and last.response.usage.output_tokens > 0

        r, raw_evs = await raw_events(c, {"input": "raw framing"}, {"X-Request-ID": "resp-frames"})
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-request-id"] == "resp-frames"
        assert raw_evs[-1]["type"] == "response.completed"
        assert raw_evs[-1]["response"]["output"][0]["content"][0]["text"] == "raw framing"
        await client.close()


async def test_stream_helper_text_deltas_and_final_response(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        deltas: list[str] = []
        async with client.responses.stream(model="m", input="the helper streams",
                                           instructions="echo it") as s:
            async for event in s:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                    assert event.snapshot == "".join(deltas)  # the helper's own accumulation
            final = await s.get_final_response()
        assert "".join(deltas) == "the helper streams" and len(deltas) > 1
        assert final.output_text == "the helper streams" and final.instructions == "echo it"
        await client.close()


async def test_reasoning_is_a_reasoning_item_with_summary_text(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        resp = await client.responses.create(model="m", input="<think>step by step</think>Final.",
                                             reasoning={"effort": "medium", "summary": "auto"})
        reasoning, message = resp.output
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
        assert [s.text for s in reasoning.summary] == ["step by step"]
        assert message.type == "message" and resp.output_text == "Final."
        assert resp.reasoning is not None and resp.reasoning.effort == "medium"
        u = resp.usage
        assert u is not None and 0 < u.output_tokens_details.reasoning_tokens < u.output_tokens

        stream = await client.responses.create(model="m", input="<think>a plan</think>Done.",
                                               stream=True)
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        assert kinds.index("response.reasoning_summary_part.added") \
            < kinds.index("response.reasoning_summary_text.delta") \
            < kinds.index("response.reasoning_summary_text.done") \
            < kinds.index("response.output_text.delta")
        summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
        assert summary == "a plan"
        assert events[-1].type == "response.completed" and events[-1].response.output_text == "Done."
        await client.close()


async def test_function_call_round_trip(echo_model_dir: Path) -> None:
    said = "Checking." + CALL
    async with running_server(echo_model_dir) as (url, engine):
        client = sdk(url)
        order: list[str] = []
        args: list[str] = []
        async with client.responses.stream(model="m", input=said, tools=TOOLS) as s:
            async for event in s:
                order.append(event.type)
                if event.type == "response.function_call_arguments.delta":
                    args.append(event.delta)
            final = await s.get_final_response()
        # the arguments stream as the tracker's fragments arrive, not at once at the end
        assert len(args) > 1 and json.loads("".join(args)) == {"city": "Paris"}
        assert order.index("response.function_call_arguments.delta") \
            < order.index("response.function_call_arguments.done")
        message, call = final.output
        assert message.type == "message" and final.output_text == "Checking."
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")
        assert json.loads(call.arguments) == {"city": "Paris"}

        # continue by id: the previous items are replayed, the prompt shares their prefix
        answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        follow = await client.responses.create(model="m", previous_response_id=final.id,
                                               input=answer, tools=TOOLS)  # type: ignore[arg-type]
        assert follow.output_text == "<tool_response>\nsunny\n</tool_response>"
        assert follow.previous_response_id == final.id
        assert follow.usage is not None and follow.usage.input_tokens_details.cached_tokens > 0

        # the same turn without the store: the client sends the items itself
        items = [{"role": "user", "content": said},
                 *[o.model_dump(exclude_none=True) for o in final.output], *answer]
        stateless = await client.responses.create(model="m", input=items, tools=TOOLS,  # type: ignore[arg-type]
                                                  store=False)
        assert stateless.output_text == follow.output_text
        assert stateless.usage is not None
        assert stateless.usage.input_tokens == follow.usage.input_tokens  # the same prompt
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(stateless.id)

        # an answer to a call that never happened
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m", input=[
                {"type": "function_call_output", "call_id": "call_nope", "output": "x"}])
        assert e.value.body["param"] == "input[0].call_id"  # type: ignore[index]

        # parallel_tool_calls: false keeps one call of two
        two = await client.responses.create(
            model="m", input=CALL + CALL.replace("get_weather", "read_file"), tools=TOOLS,
            parallel_tool_calls=False)
        assert [o.type for o in two.output] == ["function_call"] and two.parallel_tool_calls is False
        await wait_idle(engine)
        await client.close()


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]
    days: int


async def test_text_format_json_schema_and_json_object(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        # strict: the grammar holds the echo to the schema ("three" is no integer; where the
        # echo's token is masked the model samples among the allowed ones)
        parsed = await client.responses.parse(model="m", input='{"city": "Rome", "days": "three"}',
                                              text_format=Weather)
        assert isinstance(parsed.output_parsed, Weather)
        assert Weather.model_validate_json(parsed.output_text) == parsed.output_parsed
        assert parsed.text is not None and parsed.text.format is not None
        assert parsed.text.format.type == "json_schema"
        # json_object is enforced too: the echo's prose cannot open, a JSON object comes
        # (thinking off: with it on, the grammar also allows a reasoning block first, which a
        # sampled echo may open and fill up to the token limit)
        obj = await client.responses.create(model="m", input="not json at all", max_output_tokens=40,
                                            text={"format": {"type": "json_object"}},
                                            reasoning={"effort": "none"})
        assert obj.output_text.startswith("{") and "not json" not in obj.output_text, obj.output_text
        ok = await client.responses.create(model="m", input='{"ok":true}',
                                           text={"format": {"type": "json_object"}})
        assert json.loads(ok.output_text) == {"ok": True}
        await client.close()


async def test_max_output_tokens_is_incomplete(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        resp = await client.responses.create(model="m", input="word " * 40, max_output_tokens=5)
        assert resp.status == "incomplete" and resp.incomplete_details is not None
        assert resp.incomplete_details.reason == "max_output_tokens"
        assert resp.usage is not None and resp.usage.output_tokens == 5
        assert resp.output[0].status == "incomplete" and resp.max_output_tokens == 5
        stream = await client.responses.create(model="m", input="word " * 40, max_output_tokens=5,
                                               stream=True)
        events = [e async for e in stream]
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.incomplete_details is not None
        assert events[-1].response.incomplete_details.reason == "max_output_tokens"
        await client.close()


# -- the store ---------------------------------------------------------------------


async def test_previous_response_id_get_delete_and_input_items(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        client = sdk(url)
        first = await client.responses.create(model="m", input="first turn", instructions="rules")
        second = await client.responses.create(model="m", input="second turn",
                                               previous_response_id=first.id)
        assert second.output_text == "second turn" and second.instructions is None
        # the prompt is the previous turn (without its instructions) and the new input
        ids = await engine.tokenize_chat({"messages": [
            {"role": "user", "content": "first turn"}, {"role": "assistant", "content": "first turn"},
            {"role": "user", "content": "second turn"}]})
        assert second.usage is not None and second.usage.input_tokens == len(ids)
        assert second.usage.input_tokens_details.cached_tokens > 0  # the prefix cache served it

        got = await client.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == "first turn" and got.status == "completed"
        assert got.usage == first.usage
        items = [i async for i in client.responses.input_items.list(second.id, order="asc")]
        assert [(i.type, getattr(i, "role", None)) for i in items] == [
            ("message", "user"), ("message", "assistant"), ("message", "user")]
        assert [i.content[0].text for i in items] == ["first turn", "first turn", "second turn"]  # type: ignore[union-attr]
        page = await client.responses.input_items.list(second.id, limit=2)  # newest first
        assert [i.content[0].text for i in page.data] == ["second turn", "first turn"]  # type: ignore[union-attr]
        assert page.has_more

        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.create(model="m", input="x", previous_response_id=first.id)
        assert e.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
        assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
        # the second response keeps its own copy of the conversation
        third = await client.responses.create(model="m", input="third turn",
                                              previous_response_id=second.id)
        items = [i async for i in client.responses.input_items.list(third.id, order="asc")]
        assert len(items) == 5 and third.output_text == "third turn"
        await client.close()


async def test_store_false_and_the_store_size(echo_model_dir: Path) -> None:
    cfg = ServerConfig(responses_store_size=2)
    async with running_server(echo_model_dir, server=cfg) as (url, _):
        client = sdk(url)
        private = await client.responses.create(model="m", input="not kept", store=False)
        assert private.output_text == "not kept" and private.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(private.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="m", input="x", previous_response_id=private.id)
        kept = [await client.responses.create(model="m", input=f"kept {i}") for i in range(3)]
        with pytest.raises(openai.NotFoundError):  # the oldest was evicted
            await client.responses.retrieve(kept[0].id)
        assert [(await client.responses.retrieve(r.id)).output_text for r in kept[1:]] == ["kept 1", "kept 2"]
        await client.close()


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "param", "code"), [
    ({"tools": [{"type": "sorcery"}]}, "tools[0].type", "unsupported"),
    ({"background": True}, "background", "unsupported"),
    ({"input": [{"type": "mystery"}]}, "input[0].type", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type", "unsupported"),
    ({"temperature": 5}, "temperature", None),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"max_output_tokens": 100000}, None, "context_length_exceeded"),
])
async def test_bad_input_is_bad_request(echo_model_dir: Path, kwargs: dict[str, Any], param: str | None,
                                        code: str | None) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        client = sdk(url)
        body: dict[str, Any] = {"model": "m", "input": "x", **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(**body)
        err = e.value.body
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["message"]
        if param is not None:
            assert err["param"] == param
        assert err["code"] == code
        r = await c.post(RESPONSES, content=b'{"input": [}', headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        ok = await client.responses.create(model="m", input="still fine")
        assert ok.output_text == "still fine"
        await client.close()


async def test_unknown_ids_are_404(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        client = sdk(url)
        for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
            with pytest.raises(openai.NotFoundError) as e:
                await call("resp_unknown")
            assert e.value.body["param"] == "response_id"  # type: ignore[index]
        r = await c.get(f"{RESPONSES}/resp_unknown/input_items")
        assert r.status_code == 404 and r.json()["error"]["message"]
        done = await client.responses.create(model="m", input="done already")
        again = await client.responses.cancel(done.id)  # an ended response is returned unchanged
        assert again.status == "completed" and again.output_text == "done already"
        r = await c.get(f"{RESPONSES}/{done.id}", params={"stream": "true"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        r = await c.get(f"{RESPONSES}/{done.id}/input_items", params={"limit": "0"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
        await client.close()


# -- cancel ------------------------------------------------------------------------


async def test_cancel_by_response_id_stops_generation(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        client = sdk(url)
        events: list[Any] = []
        cancelled: dict[str, Any] = {}
        stream = await client.responses.create(model="m", input="word " * 3000, stream=True)

        async def cancel_when_streaming(resp_id: str) -> None:
            with trio.fail_after(20):
                while sum(e.type == "response.output_text.delta" for e in events) < 5:
                    await trio.sleep(0.01)
            running = await client.responses.retrieve(resp_id)
            assert running.status == "in_progress" and running.output
            with pytest.raises(openai.BadRequestError):  # not while it runs
                await client.responses.delete(resp_id)
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="m", input="x", previous_response_id=resp_id)
            assert e.value.body["code"] == "previous_response_in_progress"  # type: ignore[index]
            cancelled["response"] = await client.responses.cancel(resp_id)

        async with trio.open_nursery() as n:
            async for event in stream:
                events.append(event)
                if event.type == "response.created":
                    n.start_soon(cancel_when_streaming, event.response.id)
        final = events[-1]
        assert final.type == "response.incomplete" and final.response.status == "cancelled"
        assert cancelled["response"].status == "cancelled"
        assert cancelled["response"].output_text == final.response.output_text
        assert final.response.output[0].status == "incomplete"
        stats = await wait_idle(engine)
        assert stats.finished.get("cancelled") == 1
        assert stats.generation_tokens < 3000  # it did not run to its end
        stored = await client.responses.retrieve(final.response.id)
        assert stored.status == "cancelled" and stored.usage is not None
        await client.close()


async def test_cancel_by_request_id_streaming_and_not(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        client = sdk(url)
        stream = await client.responses.create(model="m", input="word " * 3000, stream=True,
                                               extra_headers={"X-Request-ID": "resp-cancel-7"})
        events: list[Any] = []
        async for event in stream:
            events.append(event)
            if sum(e.type == "response.output_text.delta" for e in events) == 5:
                r = await c.post("/v1/chat/completions/resp-cancel-7/cancel")
                assert r.status_code == 200 and r.json()["cancelled"] is True
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.status == "cancelled"
        await wait_idle(engine)

        got: dict[str, Any] = {}

        async def create() -> None:
            got["response"] = await client.responses.create(
                model="m", input="word " * 3000, extra_headers={"X-Request-ID": "resp-cancel-8"})

        async with trio.open_nursery() as n:
            n.start_soon(create)
            with trio.fail_after(20):
                while engine.statistics().generation_tokens < 20:
                    await trio.sleep(0.01)
            assert (await c.post("/v1/chat/completions/resp-cancel-8/cancel")).status_code == 200
        resp = got["response"]
        assert resp.status == "cancelled" and resp.output_text and len(resp.output_text) < len("word " * 3000)
        stats = await wait_idle(engine)
        assert stats.finished.get("cancelled") == 2
        await client.close()


async def test_client_disconnect_frees_the_slot(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        async with httpx.AsyncClient(base_url=url) as c, \
                c.stream("POST", RESPONSES, json={"input": "word " * 5000, "stream": True}) as r:
            n = 0
            resp_id = None
            async for line in r.aiter_lines():
                if line.startswith("data: ") and resp_id is None:
                    resp_id = json.loads(line[6:])["response"]["id"]
                n += 1
                if n > 30:
                    break
        abandoned = await wait_idle(engine)
        assert abandoned.generation_tokens < 5000  # it did not run to its end
        # the abandoned stream left the batch: while a probe runs to its end, the probe's
        # tokens are all the engine generates (a stream still decoding would add its own)
        client = sdk(url)
        probe = await client.responses.create(model="m", input="probe " * 20)
        after = engine.statistics()
        assert probe.status == "completed" and probe.usage is not None
        assert after.generation_tokens - abandoned.generation_tokens == probe.usage.output_tokens > 0
        assert after.running == after.requests_active == 0
        # what it produced before the client left is kept, marked cancelled
        assert resp_id is not None
        gone = await client.responses.retrieve(resp_id)
        assert gone.status == "cancelled" and gone.usage is None
        await client.close()
