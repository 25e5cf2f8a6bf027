"""What a chat template renders, and afm's tool prompt for templates that cannot.

A chat template that never reads ``tools`` (SmolLM2's, Gemma's, most base
and older instruct models') silently drops the tools a request sends.  afm
never does: for such a template it renders the tools itself, as llama.cpp's
generic tool handling does for templates without tool support, in the
Hermes / Qwen convention most instruct models have seen:

* a system prompt listing the tools as JSON inside ``<tools></tools>`` and
  asking for each call as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  (with the request's ``tool_choice`` and ``parallel_tool_calls`` spelled
  out), appended to the conversation's system message or, for a template
  that refuses a system role, put before the first user message;
* earlier assistant calls become that same ``<tool_call>`` text in the
  assistant's message, and ``tool`` results become user turns wrapped in
  ``<tool_response></tool_response>``, so templates that know neither still
  render the whole exchange;
* the model's output is parsed with the ``hermes`` tool-call format, so the
  calls stream as tool-call deltas like on a Qwen model.

This module is pure (Jinja's parser only); :mod:`afm_core._engine.prepare`
applies it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TemplateFeatures", "polyfill_tool_messages", "template_features", "tool_prompt"]


@dataclass(frozen=True, slots=True)
class TemplateFeatures:
    """Which tool-related inputs a chat template reads."""

    tools: bool  # the ``tools`` variable
    tool_calls: bool  # ``message.tool_calls`` / ``message['tool_calls']``


def template_features(template: str | None) -> TemplateFeatures:
    """Parse ``template`` (Jinja) and report what it reads; an unparsable
    template is taken to read everything (its own errors surface when it renders)."""
    if not template:
        return TemplateFeatures(tools=False, tool_calls=False)
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return TemplateFeatures(tools=True, tool_calls=True)
    tools = any(n.name == "tools" for n in ast.find_all(nodes.Name))
    calls = any(n.attr == "tool_calls" for n in ast.find_all(nodes.Getattr)) or any(
        isinstance(n.arg, nodes.Const) and n.arg.value == "tool_calls" for n in ast.find_all(nodes.Getitem)
    )
    return TemplateFeatures(tools=tools, tool_calls=calls)


def _choice_line(tool_choice: Any, parallel: bool) -> str:
    lines = []
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        lines.append(f"You must call the function {name!r} now.")
    elif tool_choice == "required":
        lines.append("You must call at least one function now.")
    if not parallel:
        lines.append("Call at most one function in this turn.")
    return "\n".join(lines)


def tool_prompt(tools: Sequence[Mapping[str, Any]], tool_choice: Any = "auto",
                parallel_tool_calls: bool = True) -> str:
    """The system prompt that describes ``tools`` (OpenAI function tools)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    extra = _choice_line(tool_choice, parallel_tool_calls)
    return f"{text}\n\n{extra}" if extra else text


def _call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    raw = fn.get("arguments") or "{}"
    try:
        args: Any = json.loads(raw)
    except ValueError:
        args = raw
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _rewrite_history(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = dict(m)
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in msg.pop("tool_calls"))
            msg["content"] = f"{msg['content']}\n{calls}" if msg.get("content") else calls
        elif msg.get("role") == "tool":
            text = f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_afm_tool"):
                out[-1]["content"] += "\n" + text
                continue
            msg = {"role": "user", "content": text, "_afm_tool": True}
        out.append(msg)
    for msg in out:
        msg.pop("_afm_tool", None)
    return out


def polyfill_tool_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    tool_choice: Any = "auto",
    parallel_tool_calls: bool = True,
    system_role: bool = True,
) -> list[dict[str, Any]]:
    """``messages`` rewritten for a template without tool support (module docstring).

    ``system_role=False`` puts the tool prompt before the first user message
    instead of into a system message (for templates that refuse one).
    """
    out = _rewrite_history(messages)
    if not tools:
        return out
    prompt = tool_prompt(tools, tool_choice, parallel_tool_calls)
    if out and out[0].get("role") == "system":
        first = out[0]
        first["content"] = f"{first.get('content') or ''}\n\n{prompt}".lstrip("\n")
    elif system_role:
        out.insert(0, {"role": "system", "content": prompt})
    else:
        user = next((m for m in out if m.get("role") == "user"), None)
        if user is None:
            out.insert(0, {"role": "user", "content": prompt})
        else:
            user["content"] = f"{prompt}\n\n{user.get('content') or ''}"
    return out
