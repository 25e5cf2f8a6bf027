"""Anthropic Messages (``POST /v1/messages``) as a sans-IO translation.

Requests::

    request = parse_request(body)          # MessagesRequest; raises RequestError
    request.chat                           # the engine's ChatRequest
    count = parse_count_tokens(body)       # ChatRequest for /v1/messages/count_tokens

Responses, streamed or not, come from one state machine fed with the
engine's events::

    writer = MessageStream(model=request.model, input_tokens=stream.prompt_tokens,
                           stop_sequences=request.stop_sequences)
    out = writer.start()                   # message_start, ping
    for batch in engine batches:
        out = writer.feed_many(batch)      # content_block_* / message_delta / message_stop
        if writer.stop_requested: engine.cancel(request_id)
    out = writer.close()                   # end of the engine stream
    writer.encode(out)                     # SSE bytes: b"event: NAME\\ndata: {...}\\n\\n"
    writer.message()                       # the non-streaming ``Message``

What maps to what:

* ``system`` (a string or text blocks) and ``system``-role entries inside
  ``messages`` become one leading system message (sources joined by a blank
  line, in order).  Consecutive turns of one role are merged (Anthropic
  combines them too).  Text blocks of one content join with ``"\\n"``.
* ``tool_use`` blocks become the assistant's tool calls (``input`` as JSON
  arguments); ``tool_result`` blocks become tool messages (before the
  turn's text); ``thinking`` blocks become the assistant's reasoning;
  ``redacted_thinking`` is dropped.  Images and documents are refused
  (400, the model reads text only); so are server tools.
* ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` are the engine's
  ``auto`` / ``required`` / a named function / ``none``;
  ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
* ``thinking`` ``enabled`` (or ``adaptive``) turns the template's reasoning
  mode on (the engine's ``enable_thinking``), ``disabled`` off; absent, the
  model's default.  ``budget_tokens`` is validated as Anthropic does but
  not enforced (thinking counts toward ``max_tokens``).
  ``output_config.effort`` is ``reasoning_effort``; ``output_config.format``
  is a strict ``json_schema`` response format.
* ``stop_sequences`` are matched here, on the answer's text (not on thinking
  or tool input), with the stream core's :class:`StopMatcher`: the matched
  sequence and what follows are never sent; :attr:`MessageStream.stop_requested`
  tells the caller to end the engine request (``engine.cancel``).  The engine
  cannot say which stop string ended a stream, and Anthropic reports it.
* Stop reasons: ``stop`` is ``end_turn``, ``tool_calls`` is ``tool_use``,
  ``length`` is ``max_tokens`` (or ``model_context_window_exceeded`` when
  the prompt and output filled the context), a matched stop sequence is
  ``stop_sequence``, and ``cancelled`` (``engine.cancel``) is ``end_turn``:
  the turn ended early, cleanly, with everything generated so far.
* Usage: ``input_tokens`` at ``message_start`` is the whole prompt; the final
  ``message_delta`` splits it into ``input_tokens`` and
  ``cache_read_input_tokens`` (the engine's prefix-cache hits), as Anthropic
  counts them; ``output_tokens`` is every generated token.

A stream opened with ``progress=True`` (the ``X-AFM-Progress: true`` header)
also carries ``prompt_progress`` events (``{"type": "prompt_progress",
"prompt_progress": {total, cache, processed, time_ms}}``) while the prompt is
prefilled; the SDK passes unknown event types through.

Errors use Anthropic's envelope (:func:`error_body`); :func:`error_status`
and :func:`error_type` map afm's errors and HTTP statuses to Anthropic's
(an :class:`EngineBusyError` is 529 ``overloaded_error``).

May import :mod:`afm_core._stream`, :mod:`afm_core._errors` and the standard
library only.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import AFMError, EngineBusyError, GenerationError, RequestError, UnsupportedError
from .._stream.events import (
    ContentDelta,
    Finish,
    PromptProgress,
    ReasoningDelta,
    StreamFailure,
    ToolCallDelta,
    Usage,
)
from .._stream.request import ChatRequest
from .._stream.sse import dumps
from .._stream.stops import StopMatcher
from .._stream.validate import as_float, json_object

__all__ = [
    "MAX_STOP_SEQUENCES",
    "MessageStream",
    "MessagesRequest",
    "count_tokens_result",
    "encode_event",
    "error_body",
    "error_status",
    "error_type",
    "new_message_id",
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


def _blocks(content: Any, path: str) -> list[dict[str, Any]]:
    """A message's content as a list of block dicts (a string is one text block)."""
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
        if kind in UNSUPPORTED_BLOCKS:
            raise UnsupportedError(f"{p}: content block type '{kind}' is not supported by this "
                                   "server (the model reads text only)", param=p)
    return content


def _text(block: dict[str, Any], path: str) -> str:
    return _str(block.get("text"), f"{path}.text")


def _texts(content: Any, path: str) -> list[str]:
    """The text of a content that may hold text blocks only (``system``, tool results)."""
    if content is None:
        return []
    out = []
    for i, block in enumerate(_blocks(content, path)):
        p = f"{path}.{i}"
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


def _tool_result_text(block: dict[str, Any], path: str) -> str:
    return "\n".join(_texts(block.get("content"), f"{path}.content"))


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


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    out = []
    names: set[str] = set()
    for i, tool in enumerate(_list(raw, "tools")):
        p = f"tools.{i}"
        _dict(tool, p)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise UnsupportedError(f"{p}.type: server tool '{kind}' is not supported by this server; "
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
    return out


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
    for turn in turns:
        if turn.role == "user":
            messages.extend(_user(turn))
        else:
            messages.append(_assistant(turn))
    tools = _tools(body.get("tools"))
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
              "show_thinking": show_thinking}
    return chat, extras


def parse_request(body: Any) -> MessagesRequest:
    """Validate a ``POST /v1/messages`` body; :class:`RequestError` (400) in Anthropic's words."""
    chat, extras = _chat_body(body, count=False)
    return MessagesRequest(chat=ChatRequest.from_openai(chat), **extras)


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


# -- errors ---------------------------------------------------------------------------

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_status(exc: AFMError) -> int:
    """The HTTP status Anthropic would answer ``exc`` with: the error's own
    hint, except a full queue (:class:`EngineBusyError`), which is 529."""
    if isinstance(exc, EngineBusyError):
        return 529
    return exc.status if 400 <= exc.status <= 599 else 500


def error_body(message: str, *, status: int, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error envelope ``{"type": "error", "error": {"type", "message"}}``."""
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


# -- responses --------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def _tool_id(call_id: str | None) -> str:
    if not call_id:
        return f"toolu_{secrets.token_hex(12)}"
    return "toolu_" + call_id.removeprefix("call_")


def encode_event(event: dict[str, Any]) -> bytes:
    """One SSE frame: ``event: TYPE`` then the event as JSON."""
    return b"event: " + event["type"].encode("ascii") + b"\ndata: " + dumps(event) + b"\n\n"


_FAILURE_TYPES = {"server_error": "api_error", "invalid_request_error": "invalid_request_error"}

TEXT, THINKING, TOOL = "text", "thinking", "tool_use"


class MessageStream:
    """One response: engine events in, Anthropic stream events (dicts) out.

    The same events build the non-streaming :meth:`message`.  Not thread-safe;
    one per request.  See the module docstring for the mapping.
    """

    def __init__(self, *, model: str, input_tokens: int = 0, id: str | None = None,
                 stop_sequences: Sequence[str] = (), context_length: int | None = None,
                 show_thinking: bool = True) -> None:
        self.id = id or new_message_id()
        self.model = model
        self.input_tokens = input_tokens
        self.context_length = context_length
        self.show_thinking = show_thinking
        self._content: list[dict[str, Any]] = []  # the Message's blocks so far
        self._args: dict[int, list[str]] = {}  # block index -> tool argument pieces
        self._open: str | None = None  # the open block's kind
        self._tool_blocks: dict[int, int] = {}  # engine tool-call index -> block index
        self._blank = ""  # whitespace-only text held before a text block opens
        self._stop_list = tuple(s for s in stop_sequences if s)
        self._stops = StopMatcher(self._stop_list) if self._stop_list else None
        self._held = ""  # the stop matcher's held tail (a possible stop prefix)
        self.stop_sequence: str | None = None
        """The stop sequence that ended the answer, once matched."""
        self.finish_reason: str | None = None
        """The engine's finish reason (``stop``, ``length``, ``tool_calls``, ``cancelled``)."""
        self.stop_reason: str | None = None
        self._usage: Usage | None = None
        self.failure: dict[str, Any] | None = None
        """The error body, if the stream failed."""
        self.ended = False
        """``message_stop`` or an error was emitted: nothing follows."""

    # -- the engine's side -------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        """A stop sequence matched before the engine finished: end the engine
        request now (``engine.cancel(request_id)``); what it still sends is dropped."""
        return self.stop_sequence is not None and self.finish_reason is None and not self.ended

    def start(self) -> list[dict[str, Any]]:
        """``message_start`` and a first ``ping``."""
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}, self.ping()]

    @staticmethod
    def ping() -> dict[str, Any]:
        return {"type": "ping"}

    def feed(self, event: object) -> list[dict[str, Any]]:
        """The Anthropic events for one engine event."""
        out: list[dict[str, Any]] = []
        if self.ended:
            return out
        answering = self.stop_sequence is None and self.finish_reason is None
        match event:
            case ContentDelta(text=text):
                if answering:
                    self._answer(text, out)
            case ReasoningDelta(text=text):
                if answering and text:
                    self._release(out)
                    self._thinking(text, out)
            case ToolCallDelta():
                if answering:
                    self._release(out)
                    self._tool(event, out)
            case Finish(reason=reason):
                if self.finish_reason is None:
                    self._release(out)
                    self._close_block(out)
                    self.finish_reason = reason
                    if self._usage is not None:
                        self._end(out)
            case Usage():
                self._usage = event
                if self.finish_reason is not None:
                    self._end(out)
            case StreamFailure(message=message, type=kind):
                out.extend(self.fail(message, type=kind))
            case PromptProgress():
                out.append({"type": "prompt_progress", "prompt_progress": event.to_dict()})
        return out  # logprobs and profiles have no Anthropic form

    def feed_many(self, events: Iterable[object]) -> list[dict[str, Any]]:
        """The events for one engine step; consecutive deltas of one block are merged."""
        out: list[dict[str, Any]] = []
        for event in events:
            for item in self.feed(event):
                if out and item["type"] == "content_block_delta" and _merge(out[-1], item):
                    continue
                out.append(item)
        return out

    def close(self) -> list[dict[str, Any]]:
        """The engine stream ended: what is still owed (an error if it never finished)."""
        out: list[dict[str, Any]] = []
        if self.ended:
            return out
        if self.finish_reason is None:
            return self.fail("the stream ended before it finished")
        self._end(out)
        return out

    def fail(self, message: str, *, type: str = "api_error") -> list[dict[str, Any]]:
        """An ``error`` event; the stream ends there."""
        if self.ended:
            return []
        self.ended = True
        self.failure = {"type": "error",
                        "error": {"type": _FAILURE_TYPES.get(type, "api_error"), "message": message}}
        return [self.failure]

    @staticmethod
    def encode(events: Iterable[dict[str, Any]]) -> bytes:
        """SSE bytes for ``events``."""
        return b"".join(encode_event(e) for e in events)

    # -- the non-streaming response ----------------------------------------------

    def message(self) -> dict[str, Any]:
        """The ``Message`` (call after :meth:`close`); :class:`GenerationError` if the stream failed."""
        if self.failure is not None:
            raise GenerationError(self.failure["error"]["message"])
        content = []
        for i, block in enumerate(self._content):
            block = dict(block)
            if block["type"] == TOOL:
                block["input"] = _tool_input("".join(self._args.get(i, ())))
            content.append(block)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": self._usage_dict()}

    # -- internals -----------------------------------------------------------------

    def _usage_dict(self) -> dict[str, Any]:
        usage = self._usage
        if usage is None:
            return {"input_tokens": self.input_tokens, "output_tokens": 0,
                    "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    def _stop_reason(self) -> str:
        reason = self.finish_reason
        if self.stop_sequence is not None:
            return "stop_sequence"
        if reason == "tool_calls":
            return "tool_use"
        if reason == "length":
            usage, ctx = self._usage, self.context_length
            if usage is not None and ctx and usage.prompt_tokens + usage.completion_tokens >= ctx:
                return "model_context_window_exceeded"
            return "max_tokens"
        return "end_turn"  # stop, and cancelled: the turn ended, with what was generated

    def _end(self, out: list[dict[str, Any]]) -> None:
        self.stop_reason = self._stop_reason()
        out.append({"type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                    "usage": self._usage_dict()})
        out.append({"type": "message_stop"})
        self.ended = True

    def _answer(self, text: str, out: list[dict[str, Any]]) -> None:
        stops = self._stops
        if stops is not None:
            buf = self._held + text
            released, stopped = stops.feed(text)
            if stopped:
                cut = len(released)
                self.stop_sequence = next(s for s in self._stop_list if buf.startswith(s, cut))
                self._held = ""
                self._text(released, out)
                self._blank = ""
                self._close_block(out)  # the answer ends here; the engine is told to stop
                return
            self._held = buf[len(released):]
            text = released
        self._text(text, out)

    def _release(self, out: list[dict[str, Any]]) -> None:
        """The answer's text run ended: what the stop matcher held is text after all."""
        if self._stops is not None and self._held:
            self._held = ""
            self._text(self._stops.flush(), out)
        self._blank = ""

    def _text(self, text: str, out: list[dict[str, Any]]) -> None:
        if not text:
            return
        if self._open != TEXT:
            if not (self._blank + text).strip():
                self._blank += text  # a text block opens with more than whitespace
                return
            text, self._blank = self._blank + text, ""
            self._open_block({"type": "text", "text": ""}, TEXT, out)
        index = len(self._content) - 1
        self._content[index]["text"] += text
        out.append({"type": "content_block_delta", "index": index,
                    "delta": {"type": "text_delta", "text": text}})

    def _thinking(self, text: str, out: list[dict[str, Any]]) -> None:
        if self._open != THINKING:
            self._open_block({"type": "thinking", "thinking": "", "signature": ""}, THINKING, out)
        if not self.show_thinking:
            return
        index = len(self._content) - 1
        self._content[index]["thinking"] += text
        out.append({"type": "content_block_delta", "index": index,
                    "delta": {"type": "thinking_delta", "thinking": text}})

    def _tool(self, event: ToolCallDelta, out: list[dict[str, Any]]) -> None:
        index = self._tool_blocks.get(event.index)
        if index is None:  # a new call (the trackers emit one call at a time)
            self._open_block({"type": TOOL, "id": _tool_id(event.id), "name": event.name or "",
                              "input": {}}, TOOL, out)
            index = len(self._content) - 1
            self._tool_blocks[event.index] = index
            self._args[index] = []
        if event.arguments:
            self._args[index].append(event.arguments)
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": event.arguments}})

    def _open_block(self, block: dict[str, Any], kind: str, out: list[dict[str, Any]]) -> None:
        self._close_block(out)
        self._content.append(block)
        self._open = kind
        out.append({"type": "content_block_start", "index": len(self._content) - 1,
                    "content_block": dict(block)})

    def _close_block(self, out: list[dict[str, Any]]) -> None:
        if self._open is not None:
            out.append({"type": "content_block_stop", "index": len(self._content) - 1})
            self._open = None


def _merge(last: dict[str, Any], item: dict[str, Any]) -> bool:
    """Append delta ``item`` to ``last`` when both extend the same block the same way."""
    if last["type"] != "content_block_delta" or last["index"] != item["index"]:
        return False
    a, b = last["delta"], item["delta"]
    if a["type"] != b["type"]:
        return False
    key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[a["type"]]
    last["delta"] = {"type": a["type"], key: a[key] + b[key]}
    return True


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's ``input``: its JSON arguments as an object (``{}`` when the model
    wrote none, or wrote something that is not a JSON object; the stream
    carried the text as written)."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
