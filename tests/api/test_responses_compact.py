"""The compaction translation without a server: what the summarising turn is,
how a compaction item renders, and the compacted object."""

from __future__ import annotations

from typing import Any

import pytest

from afm_core import RequestError
from afm_core.api import responses
from afm_core.api.responses_compact import (
    SUMMARY_PROMPT,
    compacted,
    decode_summary,
    encode_summary,
    parse,
)
from afm_core.api.responses_request import COMPACTED_HEADER


def test_the_summarising_turn_is_the_conversation_then_the_prompt_without_tools() -> None:
    call = parse({"model": "m", "instructions": "be brief", "tools": [
        {"type": "function", "name": "shell", "parameters": {"type": "object"}}],
        "input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "developer", "content": "rules"}, {"role": "user", "content": "bye"}]})
    chat = call.responses.chat
    assert [(m["role"], m["content"]) for m in chat.messages] == [
        ("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("system", "rules"),
        ("user", "bye"), ("user", SUMMARY_PROMPT)]
    assert not chat.tools and not call.responses.stream and not call.responses.store
    assert [item["content"][0]["text"] for item in call.kept] == ["hi", "bye"]


def test_compaction_items_render_as_the_summary_and_round_trip() -> None:
    content = encode_summary("did X; next Y ✓")
    assert decode_summary(content) == "did X; next Y ✓"
    call = responses.parse({"input": [{"type": "compaction", "encrypted_content": content},
                                      {"role": "user", "content": "continue"}]})
    assert call.input_items[0]["type"] == "compaction" and call.input_items[0]["id"].startswith("cmp_")
    assert [m["content"] for m in call.chat.messages] == [COMPACTED_HEADER + "did X; next Y ✓",
                                                          "continue"]


@pytest.mark.parametrize("content", ["", "opaque", "afm-compaction-v1:***", "afm-compaction-v1://8="])
def test_foreign_or_damaged_compaction_items_are_400s(content: str) -> None:
    with pytest.raises(RequestError) as info:
        responses.parse({"input": [{"type": "compaction", "encrypted_content": content}]})
    assert info.value.status == 400 and info.value.param == "input[0].encrypted_content"


def test_compacted_object_keeps_user_messages_then_one_compaction_item() -> None:
    call = parse({"input": "one"})
    usage: dict[str, Any] = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 1},
                             "total_tokens": 13}
    out = compacted(call, {"id": "resp_1", "created_at": 5.5, "usage": usage, "output": [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hidden"}]},
        {"type": "message", "content": [{"type": "output_text", "text": " the summary "}]}]})
    assert out["object"] == "response.compaction" and out["id"] == "resp_1"
    assert out["created_at"] == 5 and out["usage"] == usage
    user, item = out["output"]
    assert user["role"] == "user" and user["content"][0]["text"] == "one"
    assert item["type"] == "compaction" and decode_summary(item["encrypted_content"]) == "the summary"


def test_a_compaction_trigger_makes_the_turn_a_summary_without_tools() -> None:
    call = responses.parse({"input": [{"role": "user", "content": "hi"},
                                      {"type": "compaction_trigger"}],
                            "tools": [{"type": "function", "name": "shell",
                                       "parameters": {"type": "object"}}],
                            "text": {"format": {"type": "json_object"}}})
    assert call.compaction and not call.chat.tools and call.chat.response_format is None
    assert [m["content"] for m in call.chat.messages] == ["hi", SUMMARY_PROMPT]
    assert [item["type"] for item in call.input_items] == ["message"]


@pytest.mark.parametrize(("input", "param"), [
    ([{"type": "compaction_trigger"}], "input"),
    ([{"type": "compaction_trigger"}, {"role": "user", "content": "x"}], "input[0].type"),
])
def test_a_misplaced_or_lonely_compaction_trigger_is_a_400(input: Any, param: str) -> None:
    with pytest.raises(RequestError) as info:
        responses.parse({"input": input})
    assert info.value.status == 400 and info.value.param == param


def test_the_writer_streams_one_compaction_item_for_a_trigger() -> None:
    from afm_core import ContentDelta, Finish, ReasoningDelta, Usage

    call = responses.parse({"input": [{"role": "user", "content": "hi"},
                                      {"type": "compaction_trigger"}], "stream": True})
    w = responses.ResponseWriter(call, id="resp_1", created_at=1, model="m")
    events = w.start() + w.feed([ReasoningDelta("thinking"), ContentDelta("the "),
                                 ContentDelta("summary")])
    events += w.feed([Finish("stop"), Usage(prompt_tokens=5, completion_tokens=3)])
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.compaction.compacting", "response.compaction.compacting",
                     "response.output_item.done", "response.completed"]
    (item,) = w.response["output"]
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert decode_summary(item["encrypted_content"]) == "the summary"
    assert events[-2]["item"] == item and w.status == "completed"
