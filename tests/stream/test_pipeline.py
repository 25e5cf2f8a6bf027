"""The per-stream pipeline: c and py twins give identical events (and the right ones)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from afm_core._stream.detok_tables import DecoderTables
from afm_core._stream.events import ContentDelta, ReasoningDelta, ToolCallDelta
from afm_core._stream.structured import make_structured_output
from afm_core._stream.toolcalls.registry import make_tool_tracker
from afm_core.testing import train_tokenizer
from tests.stream.helpers import TWINSETS, TwinSet

TOK = train_tokenizer(1024)
TABLES = DecoderTables.from_tokenizer(TOK)
TOOLS = [{"type": "function", "function": {"name": "read_file"}}]

PIECES = ["<think>", "plan ", "</think>", "Answer: ", "東京 😀 ", "<tool_call>",
          '{"name": "read_file", "arguments": {"path": "a.md"}}', "</tool_call>",
          "STOP", "ST", "OP", "```json\n", '{"ok": true}', "\n```", " tail"]


def pipeline(twin: TwinSet, stops=(), *, tools=True, structured=False):
    """The twin's pipeline over the same twin's stages."""
    return twin.pipeline.StreamPipeline(
        twin.detok.IncrementalDetokenizer(TABLES),
        stops=stops,
        reasoning=twin.reasoning.ReasoningSplitter(),
        tools=make_tool_tracker("hermes", tools=TOOLS, id_factory=lambda: "call_x", impl=twin.tools)
        if tools else None,
        structured=make_structured_output({"type": "json_object"}) if structured else None,
    )


def run(p, ids):
    out: list = []
    stopped = False
    for t in ids:
        if p.feed_token(t, out):
            stopped = True
            break
    p.finish(out)
    return out, stopped


def test_events_in_order(twin: TwinSet) -> None:
    text = ('<think>plan</think>Answer: <tool_call>\n{"name": "read_file", "arguments": '
            '{"path": "a.md"}}\n</tool_call>')
    events, stopped = run(pipeline(twin), TOK.encode(text).ids)
    assert not stopped
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "plan"
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Answer: "
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert calls[0].name == "read_file" and "".join(c.arguments for c in calls) == '{"path": "a.md"}'
    events, stopped = run(pipeline(twin, ("STOP",), tools=False), TOK.encode("one two STOP three").ids)
    assert stopped and "".join(e.text for e in events) == "one two "


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.booleans(), st.booleans(), st.booleans())
def test_twins_agree(pieces: list[str], with_stop: bool, tools: bool, structured: bool) -> None:
    ids = TOK.encode("".join(pieces)).ids
    stops = ("STOP",) if with_stop else ()
    results = []
    for twin in TWINSETS:
        p = pipeline(twin, stops, tools=tools, structured=structured)
        results.append((run(p, ids), p.saw_tool_call, p.text_chars))
    assert results[0] == results[1]
