"""The request half of the Anthropic Messages translation: a Messages body into
a :class:`MessagesRequest` (the engine's ``ChatRequest`` and what the response
echoes), and ``count_tokens``.  Import it from :mod:`afm_core.api.anthropic`,
which documents what is accepted, what is refused and how blocks become chat
turns.

May import :mod:`afm_core._stream`, :mod:`afm_core._errors` and the standard
library only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from .._errors import RequestError, UnsupportedError
from ._hosted import ANTHROPIC_CLIENT_TOOLS, anthropic_client_tool, anthropic_server_tool
from ._validate import as_float, json_object
from .chat_request import CacheBreakpoint, ChatRequest

__all__ = [
    "MAX_STOP_SEQUENCES",
    "MessagesRequest",
    "count_tokens_result",
    "parse_count_tokens",
    "parse_request",
    "prompt_too_long",
    "to_chat_request",
]

MAX_MESSAGES = 100_000
MAX_STOP_SEQUENCES = 64
MAX_INT = 2**31 - 1
MIN_THINKING_BUDGET = 1024
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
UNSUPPORTED_BLOCKS = frozenset({
    "image", "document", "search_result", "container_upload", "server_tool_use",
    "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
    "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
    "tool_search_tool_result", "mcp_tool_use", "mcp_tool_result",
})


# -- request validation -------------------------------------------------------------


def _fail(path: str, problem: str) -> RequestError:
    return RequestError(f"{path}: {problem}", param=path)


def _dict(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, "Input should be a valid dictionary")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(path, "Input should be a valid list")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _fail(path, "Input should be a valid string")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, "Input should be a valid boolean")
    return value


def _int(value: Any, path: str, lo: int) -> int:
    if isinstance(value, float) and not isinstance(value, bool):
        if not value.is_integer():
            raise _fail(path, "Input should be a valid integer, got a number with a fractional part")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, "Input should be a valid integer")
    if value < lo:
        raise _fail(path, f"Input should be greater than or equal to {lo}")
    return value


def _unit(body: dict[str, Any], key: str) -> float | None:
    """An optional number in [0, 1] (``temperature``, ``top_p``)."""
    value = body.get(key)
    if value is None:
        return None
    number = as_float(value)  # an integer beyond a float's range is inf
    if number is None:
        raise _fail(key, "Input should be a valid number")
    if not math.isfinite(number) or number > 1:
        raise _fail(key, "Input should be less than or equal to 1")
    if number < 0:
        raise _fail(key, "Input should be greater than or equal to 0")
    return number


def _required(body: dict[str, Any], key: str) -> Any:
    if body.get(key) is None:
        raise _fail(key, "Field required")
    return body[key]


def _blocks(content: Any, path: str, allowed: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """A message's content as a list of block dicts (a string is one text block);
    a block type this server does not read is refused unless ``allowed``."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _fail(path, "Input should be a valid string or a list of content blocks")
    for i, block in enumerate(content):
        p = f"{path}.{i}"
        _dict(block, p)
        kind = block.get("type")
        if not isinstance(kind, str):
            raise _fail(f"{p}.type", "Field required")
        if kind in UNSUPPORTED_BLOCKS and kind not in allowed:
            raise UnsupportedError(f"{p}: content block type '{kind}' is not supported by this "
                                   "server (the model reads text only)", param=p)
    return content


def _text(block: dict[str, Any], path: str) -> str:
    return _str(block.get("text"), f"{path}.text")


def _texts(content: Any, path: str, omit: frozenset[str] = frozenset()) -> list[str]:
    """The text of a content that may hold text blocks only (``system``, tool results);
    a block of a type in ``omit`` is a note that it was left out."""
    if content is None:
        return []
    out = []
    for i, block in enumerate(_blocks(content, path, allowed=omit)):
        p = f"{path}.{i}"
        if block["type"] in omit:
            out.append(f"[{block['type']} omitted: this model reads text only]")
            continue
        if block["type"] != "text":
            raise _fail(f"{p}.type", f"Input tag '{block['type']}' found using 'type' does not "
                        "match the expected tag: 'text'")
        out.append(_text(block, p))
    return out


@dataclass(slots=True)
class _Turn:
    role: str
    blocks: list[tuple[str, dict[str, Any]]]  # (path, block)


def _turns(raw: Any) -> tuple[list[_Turn], list[str]]:
    """Validated turns (consecutive roles merged) and the system texts found inside."""
    messages = _list(raw, "messages")
    if not messages:
        raise _fail("messages", "List should have at least 1 item")
    if len(messages) > MAX_MESSAGES:
        raise _fail("messages", f"List should have at most {MAX_MESSAGES} items")
    turns: list[_Turn] = []
    system: list[str] = []
    for i, message in enumerate(messages):
        p = f"messages.{i}"
        _dict(message, p)
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise _fail(f"{p}.role", "Input should be 'user' or 'assistant'")
        if "content" not in message:
            raise _fail(f"{p}.content", "Field required")
        if role == "system":  # recent Claude Code sends these: folded into the system prompt
            system.append("\n".join(_texts(message["content"], f"{p}.content")))
            continue
        blocks = [(f"{p}.content.{j}", b) for j, b in enumerate(_blocks(message["content"], f"{p}.content"))]
        if turns and turns[-1].role == role:
            turns[-1].blocks.extend(blocks)
        else:
            turns.append(_Turn(role, blocks))
    if not turns:
        raise _fail("messages", "at least one user message is required")
    if turns[-1].role == "assistant":
        raise UnsupportedError("messages: the final message must be a user message; this server "
                               "does not support prefilling the assistant's response", param="messages")
    return turns, system


OMITTED_IN_TOOL_RESULTS = frozenset({"image", "document"})
"""Blocks a tool's result may hold that the model cannot read: each becomes a
note saying so.  Refused, they would end an agent's session: the client keeps
them in its history, so every later request would be refused too (Claude
Code's Read tool returns a picture file as an image block)."""


def _tool_result_text(block: dict[str, Any], path: str) -> str:
    return "\n".join(_texts(block.get("content"), f"{path}.content", omit=OMITTED_IN_TOOL_RESULTS))


def _user(turn: _Turn) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    texts: list[str] = []
    for path, block in turn.blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, path))
        elif kind == "tool_result":
            tid = _str(_required_in(block, "tool_use_id", path), f"{path}.tool_use_id")
            if block.get("is_error") is not None:
                _bool(block["is_error"], f"{path}.is_error")
            tools.append({"role": "tool", "tool_call_id": tid, "content": _tool_result_text(block, path)})
        elif kind in ("thinking", "redacted_thinking", "tool_use"):
            raise _fail(f"{path}.type", f"'{kind}' blocks belong to assistant messages")
        else:
            raise _fail(f"{path}.type", f"unknown content block type '{kind}'")
    out = tools
    if texts or not tools:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(turn: _Turn) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for path, block in turn.blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, path))
        elif kind == "thinking":
            thinking.append(_str(block.get("thinking"), f"{path}.thinking"))
        elif kind == "redacted_thinking":
            continue  # opaque to this server
        elif kind == "tool_use":
            tid = _str(_required_in(block, "id", path), f"{path}.id")
            name = _str(_required_in(block, "name", path), f"{path}.name")
            args = _dict(_required_in(block, "input", path), f"{path}.input")
            calls.append({"id": tid, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result":
            raise _fail(f"{path}.type", "'tool_result' blocks belong to user messages")
        else:
            raise _fail(f"{path}.type", f"unknown content block type '{kind}'")
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return msg


def _required_in(block: dict[str, Any], key: str, path: str) -> Any:
    if block.get(key) is None:
        raise _fail(f"{path}.{key}", "Field required")
    return block[key]


def _system(body: dict[str, Any], inside: list[str]) -> str | None:
    sources = []
    if body.get("system") is not None:
        sources.append("\n".join(_texts(body["system"], "system")))
    sources.extend(inside)
    return "\n\n".join(sources) if sources else None


def _tools(raw: Any) -> tuple[list[dict[str, Any]] | None, tuple[str, ...]]:
    """(the client tools as chat tools, the server tools skipped, by type)."""
    if raw is None:
        return None, ()
    out = []
    names: set[str] = set()
    skipped: list[str] = []
    for i, tool in enumerate(_list(raw, "tools")):
        p = f"tools.{i}"
        _dict(tool, p)
        kind = tool.get("type")
        if anthropic_server_tool(kind):  # Anthropic runs it: not offered to the model here
            skipped.append(kind)
            continue
        if isinstance(kind, str) and kind in ANTHROPIC_CLIENT_TOOLS:
            try:
                typed = anthropic_client_tool(kind, tool.get("name"), tool)
            except ValueError as exc:
                raise _fail(f"{p}.name", str(exc)) from None
            if typed["name"] in names:
                raise _fail("tools", f"Tool names must be unique ('{typed['name']}' is repeated)")
            names.add(str(typed["name"]))
            out.append({"type": "function", "function": typed})
            continue
        if kind not in (None, "custom"):
            raise UnsupportedError(f"{p}.type: tool type '{kind}' is not supported by this server "
                                   f"(typed client tools served: {', '.join(ANTHROPIC_CLIENT_TOOLS)}); "
                                   "define client tools with 'name' and 'input_schema'", param=p)
        name = _str(_required_in(tool, "name", p), f"{p}.name")
        if not TOOL_NAME.fullmatch(name):
            raise _fail(f"{p}.name", f"String should match pattern '^{TOOL_NAME.pattern}$'")
        if name in names:
            raise _fail("tools", f"Tool names must be unique ('{name}' is repeated)")
        names.add(name)
        schema = _dict(_required_in(tool, "input_schema", p), f"{p}.input_schema")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if tool.get("description") is not None:
            fn["description"] = _str(tool["description"], f"{p}.description")
        if tool.get("strict") is not None and _bool(tool["strict"], f"{p}.strict"):
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out, tuple(dict.fromkeys(skipped))


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> tuple[Any, bool]:
    """``(OpenAI tool_choice, parallel_tool_calls)``."""
    if raw is None:
        return None, True
    choice = _dict(raw, "tool_choice")
    kind = choice.get("type")
    parallel = True
    if choice.get("disable_parallel_tool_use") is not None:
        parallel = not _bool(choice["disable_parallel_tool_use"], "tool_choice.disable_parallel_tool_use")
    if kind == "auto":
        return ("auto" if tools else None), parallel
    if kind == "none":
        return "none", parallel
    if kind == "any":
        if not tools:
            raise _fail("tool_choice", "tool_choice 'any' requires 'tools'")
        return "required", parallel
    if kind == "tool":
        name = _str(_required_in(choice, "name", "tool_choice"), "tool_choice.name")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise _fail("tool_choice.name", f"tool '{name}' is not in 'tools'")
        return {"type": "function", "function": {"name": name}}, parallel
    raise _fail("tool_choice.type", "Input should be 'auto', 'any', 'tool' or 'none'")


def _thinking(raw: Any, max_tokens: int | None) -> tuple[bool | None, bool]:
    """``(enable_thinking, show thinking text)``."""
    if raw is None:
        return None, True
    thinking = _dict(raw, "thinking")
    kind = thinking.get("type")
    show = True
    display = thinking.get("display")
    if display is not None:
        if display not in ("summarized", "omitted"):
            raise _fail("thinking.display", "Input should be 'summarized' or 'omitted'")
        show = display == "summarized"
    if kind == "disabled":
        return False, show
    if kind in ("adaptive", "between_tools"):
        return True, show
    if kind == "enabled":
        budget = _int(_required_in(thinking, "budget_tokens", "thinking"), "thinking.budget_tokens",
                      MIN_THINKING_BUDGET)
        if max_tokens is not None and budget >= max_tokens:
            raise _fail("thinking.budget_tokens", "`max_tokens` must be greater than "
                        "`thinking.budget_tokens`")
        return True, show
    raise _fail("thinking.type", "Input should be 'enabled', 'disabled' or 'adaptive'")


def _output_config(raw: Any) -> tuple[str | None, dict[str, Any] | None]:
    """``(reasoning_effort, response_format)``."""
    if raw is None:
        return None, None
    config = _dict(raw, "output_config")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise _fail("output_config.effort", "Input should be 'low', 'medium', 'high', 'xhigh' or 'max'")
    fmt = config.get("format")
    response_format = None
    if fmt is not None:
        _dict(fmt, "output_config.format")
        if fmt.get("type") != "json_schema":
            raise _fail("output_config.format.type", "Input should be 'json_schema'")
        schema = _dict(_required_in(fmt, "schema", "output_config.format"), "output_config.format.schema")
        response_format = {"type": "json_schema",
                           "json_schema": {"name": "output", "schema": schema, "strict": True}}
    return (EFFORTS[effort] if effort is not None else None), response_format


def _stop_sequences(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = _list(raw, "stop_sequences")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _fail("stop_sequences", f"List should have at most {MAX_STOP_SEQUENCES} items")
    for i, stop in enumerate(stops):
        if not _str(stop, f"stop_sequences.{i}"):
            raise _fail(f"stop_sequences.{i}", "String should have at least 1 character")
    return tuple(stops)


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """One validated ``POST /v1/messages`` body."""

    chat: ChatRequest
    """What the engine runs (without the stop sequences: :class:`MessageStream` matches them)."""
    model: str
    stream: bool
    max_tokens: int
    stop_sequences: tuple[str, ...] = ()
    show_thinking: bool = True
    """False for ``thinking.display: "omitted"``: thinking blocks are sent empty."""


def _cache_control(block: Any, path: str) -> float | None:
    """The ``ttl`` in seconds of a block's ``cache_control`` (None: no breakpoint)."""
    if not isinstance(block, dict) or block.get("cache_control") is None:
        return None
    control = _dict(block["cache_control"], f"{path}.cache_control")
    if control.get("type") != "ephemeral":
        raise _fail(f"{path}.cache_control.type", "Input should be 'ephemeral'")
    ttl = control.get("ttl")
    if ttl is None:
        return CACHE_TTLS["5m"]
    if ttl not in CACHE_TTLS:
        raise _fail(f"{path}.cache_control.ttl", "Input should be '5m' or '1h'")
    return CACHE_TTLS[ttl]


def _breakpoints(body: dict[str, Any], turns: list[_Turn], ends: list[int]) -> tuple[CacheBreakpoint, ...]:
    """The ``cache_control`` breakpoints of tools, ``system`` blocks and messages
    (``ends[i]``: the chat messages that turns up to ``i`` make)."""
    out: list[CacheBreakpoint] = []
    kept = 0
    for i, tool in enumerate(body.get("tools") or ()):
        if not anthropic_server_tool(tool.get("type")):
            kept += 1
        ttl = _cache_control(tool, f"tools.{i}")
        if ttl is not None:
            out.append(CacheBreakpoint(messages=0, ttl=ttl, tools=kept))
    system = body.get("system")
    if isinstance(system, list):
        texts = _texts(system, "system")
        for j, block in enumerate(system):
            ttl = _cache_control(block, f"system.{j}")
            if ttl is not None:
                out.append(CacheBreakpoint(messages=1, ttl=ttl, system="\n".join(texts[: j + 1])))
    for turn, end in zip(turns, ends, strict=True):
        ttls = [t for path, block in turn.blocks if (t := _cache_control(block, path)) is not None]
        if ttls:
            out.append(CacheBreakpoint(messages=end, ttl=max(ttls)))
    return tuple(out)


def _chat_body(body: Any, *, count: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(OpenAI-style chat body, Anthropic extras)``, validated in Anthropic's words."""
    body = json_object(body)
    model = _str(_required(body, "model"), "model")
    max_tokens: int | None = None
    if not count:
        max_tokens = _int(_required(body, "max_tokens"), "max_tokens", 1)
    turns, inside = _turns(_required(body, "messages"))
    system = _system(body, inside)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system is not None else []
    ends: list[int] = []
    for turn in turns:
        if turn.role == "user":
            messages.extend(_user(turn))
        else:
            messages.append(_assistant(turn))
        ends.append(len(messages))
    tools, skipped = _tools(body.get("tools"))
    breakpoints = _breakpoints(body, turns, ends)
    tool_choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    enable_thinking, show_thinking = _thinking(body.get("thinking"), max_tokens)
    effort, response_format = _output_config(body.get("output_config"))
    if body.get("metadata") is not None:
        metadata = _dict(body["metadata"], "metadata")
        if metadata.get("user_id") is not None:
            _str(metadata["user_id"], "metadata.user_id")
    stream = _bool(body["stream"], "stream") if body.get("stream") is not None else False
    chat: dict[str, Any] = {"model": model, "messages": messages}
    if max_tokens is not None and max_tokens <= MAX_INT:
        chat["max_tokens"] = max_tokens  # beyond: as much as the context allows
    for key in ("temperature", "top_p"):
        value = _unit(body, key)
        if value is not None:
            chat[key] = value
    if body.get("top_k") is not None:
        chat["top_k"] = min(_int(body["top_k"], "top_k", 0), 1_000_000)
    if tools:
        chat["tools"] = tools
        chat["parallel_tool_calls"] = parallel
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    if enable_thinking is not None:
        chat["enable_thinking"] = enable_thinking
    if effort is not None:
        chat["reasoning_effort"] = effort
    if response_format is not None:
        chat["response_format"] = response_format
    extras = {"model": model, "stream": stream, "max_tokens": max_tokens or 0,
              "stop_sequences": _stop_sequences(body.get("stop_sequences")) if not count else (),
              "show_thinking": show_thinking, "skipped": skipped, "breakpoints": breakpoints}
    return chat, extras


def parse_request(body: Any) -> MessagesRequest:
    """Validate a ``POST /v1/messages`` body; :class:`RequestError` (400) in Anthropic's words."""
    chat, extras = _chat_body(body, count=False)
    skipped = extras.pop("skipped")
    breakpoints = extras.pop("breakpoints")
    request = ChatRequest.from_openai(chat)
    if skipped:
        request = replace(request, skipped_tools=skipped)
    if breakpoints:
        request = replace(request, cache_breakpoints=breakpoints)
    return MessagesRequest(chat=request, **extras)


def to_chat_request(body: Any) -> ChatRequest:
    """The engine request for a Messages body (its stop sequences are
    :class:`MessageStream`'s to match: see :func:`parse_request`)."""
    return parse_request(body).chat


def parse_count_tokens(body: Any) -> ChatRequest:
    """The engine request a ``POST /v1/messages/count_tokens`` body counts
    (the same fields as a message, without ``max_tokens``)."""
    chat, _ = _chat_body(body, count=True)
    return ChatRequest.from_openai(chat)


def count_tokens_result(input_tokens: int) -> dict[str, Any]:
    """The ``count_tokens`` response body."""
    return {"input_tokens": input_tokens}


def prompt_too_long(tokens: int, context_length: int) -> RequestError:
    """Anthropic's error for a prompt beyond the context, in its words (Claude
    Code compacts the conversation when it reads "prompt is too long")."""
    return RequestError(f"prompt is too long: {tokens} tokens > {context_length} maximum",
                        param="messages", code="context_length_exceeded")
