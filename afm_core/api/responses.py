"""OpenAI Responses (``POST /v1/responses``), as a sans-IO translation.

:func:`parse` validates a Responses body into a :class:`ResponsesCall`: the
engine's :class:`~afm_core.ChatRequest` (built as an OpenAI chat body and
validated by ``ChatRequest.from_openai``) plus what the Response object
echoes.  :class:`ResponseWriter` turns the engine's events into the
Responses streaming events and the final Response object::

    call = responses.parse(body, previous=store.get)     # raises RequestError
    async with engine.stream(call.chat) as stream:
        writer = responses.ResponseWriter(call, id=responses.new_id("resp"),
                                          created_at=stream.created, model=stream.model)
        sse = responses.encode(writer.start())
        async for batch in stream.batches():
            sse = responses.encode(writer.feed(batch))
        sse = responses.encode(writer.end())
    store.put(writer.stored())                           # when call.store
    writer.response                                      # the Response object

The request.  ``input`` is a string (one user message) or a list of items:
messages (roles ``user``, ``system``, ``developer``, ``assistant``; string
content or ``input_text`` / ``output_text`` / ``refusal`` parts),
``function_call``, ``function_call_output`` (string output or text parts;
its ``call_id`` must name a function call earlier in the conversation) and
``reasoning`` (its text goes back to the template as the assistant turn's
``reasoning_content``; ``encrypted_content`` is ignored).  Consecutive
assistant-side items (reasoning, assistant messages, function calls) form one
assistant turn; a reasoning item that no assistant content or call follows is
dropped.  ``instructions`` is a first system message (not carried over by
``previous_response_id``, as OpenAI's).  ``previous_response_id`` replays
the stored response's input and output items before the new input, so the
prompt shares its prefix with the previous one (the engine's prefix cache);
an unknown id is OpenAI's 404 ``previous_response_not_found``.  Function
``tools`` use the flat shape (``strict: true`` asks for grammar-enforced
arguments; omitted or null means false here, where OpenAI's server defaults
to true); ``tool_choice`` is ``auto``, ``none``, ``required``, a named
function, or ``allowed_tools`` (the tools are narrowed to that list).
``text.format`` ``json_object`` / ``json_schema`` (``strict`` enforced by
the engine's grammar) is the chat ``response_format``.  ``reasoning.effort``
goes to the chat template (``none`` turns thinking off; ``xhigh`` and
``max`` are sent as ``high``); ``reasoning.summary`` is echoed, the summary
is always the model's whole reasoning text.  ``include`` with
``message.output_text.logprobs`` (or ``top_logprobs`` > 0) adds logprobs to
the text.  ``truncation: "auto"`` is accepted but nothing is truncated (a
prompt past the context is still a 400).  Hosted tools (``web_search``,
``file_search``, ...), ``background: true``, ``conversation``, ``prompt``
templates, ``context_management``, ``item_reference`` items and non-text
content (images, files, audio) are a 400 :class:`UnsupportedError`; unknown
fields are ignored.

The events, each with ``type`` and a ``sequence_number`` counting from 0:
``response.created`` and ``response.in_progress`` (status ``in_progress``);
per output item ``response.output_item.added``, its content events, then
``response.output_item.done``:

* reasoning (``rs_…``): ``response.reasoning_summary_part.added``,
  ``response.reasoning_summary_text.delta`` …, ``.done``,
  ``response.reasoning_summary_part.done``;
* a message (``msg_…``): ``response.content_part.added`` (``output_text``),
  ``response.output_text.delta`` …, ``.done``, ``response.content_part.done``;
* a function call (``fc_…``, ``call_id`` from the engine's tool-call
  tracker): ``response.function_call_arguments.delta`` as each fragment
  arrives, then ``.done``.

Reasoning and message items close when the next item of another kind begins;
function calls (whose fragments may interleave) close at the end, in output
order.  The stream ends with one of ``response.completed`` (finish ``stop`` or
``tool_calls``), ``response.incomplete`` (finish ``length``:
``incomplete_details.reason = "max_output_tokens"``; or cancelled: status
``cancelled``, ``incomplete_details`` null, since the SDK has no cancelled
event) or ``response.failed`` (a mid-stream failure: ``error.code
"server_error"``).  Open items are closed first, ``incomplete`` unless the
response completed.  A response that completes without any output item gets
an empty message, so ``output_text`` is ``""``.

Usage: ``input_tokens`` (``input_tokens_details.cached_tokens``: the prefix
cache's), ``output_tokens``, ``total_tokens``; ``output_tokens_details.
reasoning_tokens`` is whatever the caller sets in :attr:`ResponseWriter.
reasoning_tokens` before the finish (afm's HTTP route re-tokenizes the
reasoning text), else 0.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard
library.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .._errors import RequestError, UnsupportedError
from .._stream.events import (
    ContentDelta,
    Event,
    Finish,
    LogprobsDelta,
    ReasoningDelta,
    StreamFailure,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from .._stream.request import MAX_INT, MAX_TOP_LOGPROBS, ChatRequest, _valid_text
from .._stream.sse import dumps
from .responses_store import StoredResponse

__all__ = [
    "ResponseWriter",
    "ResponsesCall",
    "encode",
    "new_id",
    "parse",
]

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SUMMARIES = ("auto", "concise", "detailed")
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image_url", "image", "file")
MAX_METADATA = 16
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MIN_LOGPROB = -9999.0
# item types of hosted tools and other features afm does not run
UNSUPPORTED_ITEMS = frozenset({
    "item_reference", "file_search_call", "web_search_call", "computer_call", "computer_call_output",
    "image_generation_call", "code_interpreter_call", "local_shell_call", "local_shell_call_output",
    "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output", "mcp_call",
    "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "custom_tool_call",
    "custom_tool_call_output", "tool_search_call", "tool_search_output", "compaction", "program",
    "program_output", "additional_tools",
})
# chat-body parameter names as the Responses body spells them
_RENAMED = (("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"), ("reasoning_effort", "reasoning.effort"),
            ("messages", "input"))


def new_id(prefix: str) -> str:
    """A fresh id like OpenAI's: ``prefix``, ``_`` and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def _err(message: str, param: str) -> RequestError:
    return RequestError(message, param=param)


# -- the request -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    """A validated Responses body: the engine request and what the response echoes."""

    chat: ChatRequest
    """What the engine runs."""
    input_items: tuple[dict[str, Any], ...]
    """This body's input, as normalized items (each with an ``id``)."""
    history: tuple[dict[str, Any], ...] = ()
    """The previous response's input and output items (``previous_response_id``)."""
    settings: tuple[tuple[str, Any], ...] = ()
    """The request fields the Response object echoes, in OpenAI's order."""
    stream: bool = False
    store: bool = True
    logprobs: bool = False

    @property
    def conversation(self) -> tuple[dict[str, Any], ...]:
        """The items the response is generated from (what it stores as its input)."""
        return self.history + self.input_items


def _opt_str(body: dict[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise _err(f"'{key}' must be a string", key)
    return v


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _err(f"'{key}' must be a boolean", key)
    return v


def _count(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _err(f"'{key}' must be an integer between {lo} and {hi}", key)
    return v


def _unsupported(body: dict[str, Any]) -> None:
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise _err("'background' must be a boolean", "background")
    if background:
        raise UnsupportedError("background responses are not supported: stream the response, "
                               "or wait for it", param="background")
    if body.get("conversation") is not None:
        raise UnsupportedError("conversations are not supported: continue with "
                               "previous_response_id, or send the items", param="conversation")
    if body.get("prompt") is not None:
        raise UnsupportedError("prompt templates are not supported: send 'input' and "
                               "'instructions'", param="prompt")
    if body.get("context_management"):
        raise UnsupportedError("context management (compaction) is not supported",
                               param="context_management")


def _metadata(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_METADATA:
        raise _err(f"'metadata' must be an object of at most {MAX_METADATA} pairs", "metadata")
    for k, v in raw.items():
        if not isinstance(k, str) or len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise _err("metadata keys must be strings of at most 64 characters, values strings "
                       "of at most 512", "metadata")
        _valid_text(k, "metadata")
        _valid_text(v, "metadata")
    return dict(raw)


def _include(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise _err("'include' must be an array of strings", "include")
    return tuple(raw)


# -- input items -------------------------------------------------------------------


def _parts_text(content: Any, param: str, *, role: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return _valid_text(content, param)
    if not isinstance(content, list):
        raise _err("message content must be a string or an array of content parts", param)
    out = []
    for i, part in enumerate(content):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise _err("content parts must be objects", p)
        kind = part.get("type")
        key = "refusal" if kind == "refusal" and role == "assistant" else "text"
        if kind in TEXT_PARTS or key == "refusal":
            text = part.get(key)
            if not isinstance(text, str):
                raise _err(f"a {kind} part needs a string '{key}'", f"{p}.{key}")
            out.append(text)
        elif kind in MEDIA_PARTS:
            raise UnsupportedError(f"content part type '{kind}' is not supported by this model "
                                   "(text only)", param=f"{p}.type")
        else:
            raise _err(f"unknown content part type {kind!r}", f"{p}.type")
    return _valid_text("".join(out), param)


def _item_id(item: dict[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else new_id(prefix)


def _required_str(item: dict[str, Any], key: str, param: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise _err(f"'{key}' must be a non-empty string", f"{param}.{key}")
    return _valid_text(v, f"{param}.{key}")


def _message_item(item: dict[str, Any], p: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise _err(f"a message's role must be one of {', '.join(INPUT_ROLES)}", f"{p}.role")
    if "content" not in item:
        raise _err("a message needs 'content'", f"{p}.content")
    text = _parts_text(item["content"], f"{p}.content", role=role)
    if role == "assistant":
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    else:
        part = {"type": "input_text", "text": text}
    return {"id": _item_id(item, "msg"), "type": "message", "role": role, "content": [part],
            "status": "completed"}


def _reasoning_item(item: dict[str, Any], p: str) -> dict[str, Any]:
    out: dict[str, Any] = {"id": _item_id(item, "rs"), "type": "reasoning"}
    for key, kind in (("summary", "summary_text"), ("content", "reasoning_text")):
        raw = item.get(key)
        if raw is None:
            if key == "summary":
                raw = []
            else:
                continue
        if not isinstance(raw, list):
            raise _err(f"a reasoning item's '{key}' must be an array", f"{p}.{key}")
        parts = []
        for i, part in enumerate(raw):
            if not isinstance(part, dict) or part.get("type") != kind \
                    or not isinstance(part.get("text"), str):
                raise _err(f"each {key} part must be {{'type': '{kind}', 'text': ...}}",
                           f"{p}.{key}[{i}]")
            parts.append({"type": kind, "text": _valid_text(part["text"], f"{p}.{key}[{i}]")})
        out[key] = parts
    return out


def _output_text(raw: Any, p: str) -> str:
    if isinstance(raw, str):
        return _valid_text(raw, p)
    if isinstance(raw, list):
        return _parts_text(raw, p, role="tool")
    raise _err("a function call output must be a string or an array of text parts", p)


def _input_item(item: Any, p: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise _err("each input item must be an object", p)
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"
    if kind == "message":
        return _message_item(item, p)
    if kind == "function_call":
        args = item.get("arguments")
        if not isinstance(args, str):
            raise _err("'arguments' must be a JSON string", f"{p}.arguments")
        return {"id": _item_id(item, "fc"), "type": "function_call",
                "call_id": _required_str(item, "call_id", p), "name": _required_str(item, "name", p),
                "arguments": _valid_text(args, f"{p}.arguments"), "status": "completed"}
    if kind == "function_call_output":
        if "output" not in item:
            raise _err("a function call output needs 'output'", f"{p}.output")
        return {"id": _item_id(item, "fco"), "type": "function_call_output",
                "call_id": _required_str(item, "call_id", p),
                "output": _output_text(item["output"], f"{p}.output"), "status": "completed"}
    if kind == "reasoning":
        return _reasoning_item(item, p)
    if isinstance(kind, str) and kind in UNSUPPORTED_ITEMS:
        raise UnsupportedError(f"input items of type '{kind}' are not supported: afm runs "
                               "function tools only (send items themselves, not references)",
                               param=f"{p}.type")
    raise _err(f"unknown input item type {kind!r}", f"{p}.type")


def _input_items(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        raise _err("'input' is required", "input")
    if isinstance(raw, str):
        text = _valid_text(raw, "input")
        return ({"id": new_id("msg"), "type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": text}], "status": "completed"},)
    if not isinstance(raw, list) or not raw:
        raise _err("'input' must be a string or a non-empty array of input items", "input")
    return tuple(_input_item(item, f"input[{i}]") for i, item in enumerate(raw))


def _item_text(item: dict[str, Any], key: str = "content") -> str:
    return "".join(p.get("text", p.get("refusal", "")) for p in item.get(key) or ())


def to_messages(items: Iterable[dict[str, Any]], *, instructions: str | None = None,
                first_new: int = 0) -> list[dict[str, Any]]:
    """OpenAI chat messages for normalized items: consecutive assistant-side
    items (reasoning, assistant messages, function calls) form one assistant
    turn.  ``first_new`` is the index of the first item of this body's input
    (earlier ones came from ``previous_response_id``), for error params."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    call_ids: set[str] = set()

    def flush() -> None:
        if content or calls:
            turn: dict[str, Any] = {"role": "assistant",
                                    "content": "".join(content) if content or not calls else None}
            if calls:
                turn["tool_calls"] = list(calls)
            if reasoning:
                turn["reasoning_content"] = "\n\n".join(reasoning)
            out.append(turn)
        reasoning.clear()
        content.clear()
        calls.clear()

    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "reasoning":
            if content or calls:  # a new step of the same assistant turn: its own message
                flush()
            text = _item_text(item) or "\n\n".join(p["text"] for p in item.get("summary") or ())
            if text:
                reasoning.append(text)
        elif kind == "message" and item["role"] == "assistant":
            content.append(_item_text(item))
        elif kind == "function_call":
            call_ids.add(item["call_id"])
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            flush()
            if item["call_id"] not in call_ids:
                raise _err(f"No tool call found for function call output with call_id "
                           f"{item['call_id']!r}.", f"input[{max(i - first_new, 0)}].call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            flush()
            out.append({"role": item["role"], "content": _item_text(item)})
    flush()
    return out


# -- tools, formats, reasoning ----------------------------------------------------------


def _tools(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the tools as the Response echoes them, the chat body's tools)."""
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise _err("'tools' must be an array", "tools")
    echo, chat = [], []
    names: set[str] = set()
    for i, t in enumerate(raw):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _err("each tool must be an object", p)
        kind = t.get("type")
        if kind != "function":
            if isinstance(kind, str) and kind:
                raise UnsupportedError(f"tool type '{kind}' is not supported: afm runs function "
                                       "tools only", param=f"{p}.type")
            raise _err("each tool needs a 'type' ('function')", f"{p}.type")
        name = t.get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= 256:
            raise _err("a function tool needs a 'name' (1-256 characters)", f"{p}.name")
        _valid_text(name, f"{p}.name")
        if name in names:
            raise _err(f"duplicate tool name {name!r}", f"{p}.name")
        names.add(name)
        params = t.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _err("'parameters' must be a JSON schema object", f"{p}.parameters")
        desc = t.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _err("'description' must be a string", f"{p}.description")
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _err("'strict' must be a boolean", f"{p}.strict")
        echo.append({"type": "function", "name": name, "description": desc, "parameters": params,
                     "strict": bool(strict)})
        fn: dict[str, Any] = {"name": name, "parameters": params}
        if desc is not None:
            fn["description"] = desc
        if strict:
            fn["strict"] = True
        chat.append({"type": "function", "function": fn})
    return echo, chat


def _tool_choice(raw: Any, chat_tools: list[dict[str, Any]]) -> tuple[Any, Any, list[dict[str, Any]]]:
    """(the echoed tool_choice, the chat tool_choice, the chat tools it leaves)."""
    names = [t["function"]["name"] for t in chat_tools]
    if raw is None:
        return "auto", None, chat_tools
    if raw in ("auto", "none", "required"):
        if raw == "required" and not chat_tools:
            raise _err("tool_choice 'required' needs tools", "tool_choice")
        return raw, raw if chat_tools else None, chat_tools
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "function":
            name = raw.get("name")
            if not isinstance(name, str) or name not in names:
                raise _err(f"tool_choice names an unknown function {name!r}", "tool_choice.name")
            return ({"type": "function", "name": name},
                    {"type": "function", "function": {"name": name}}, chat_tools)
        if kind == "allowed_tools":
            mode = raw.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise _err("allowed_tools 'mode' must be auto or required", "tool_choice.mode")
            allowed = raw.get("tools")
            if not isinstance(allowed, list) or not allowed:
                raise _err("allowed_tools needs a non-empty 'tools' array", "tool_choice.tools")
            keep: list[str] = []
            for i, t in enumerate(allowed):
                p = f"tool_choice.tools[{i}]"
                if not isinstance(t, dict) or t.get("type") != "function":
                    raise UnsupportedError("allowed_tools may list function tools only", param=p)
                if t.get("name") not in names:
                    raise _err(f"allowed_tools names an unknown function {t.get('name')!r}",
                               f"{p}.name")
                keep.append(t["name"])
            subset = [t for t in chat_tools if t["function"]["name"] in keep]
            echo = {"type": "allowed_tools", "mode": mode,
                    "tools": [{"type": "function", "name": n} for n in keep]}
            return echo, mode, subset
        if isinstance(kind, str) and kind:
            raise UnsupportedError(f"tool_choice type '{kind}' is not supported: afm runs function "
                                   "tools only", param="tool_choice.type")
    raise _err("'tool_choice' must be auto, none, required, a function or allowed_tools",
               "tool_choice")


def _text(raw: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the echoed ``text``, the chat ``response_format``)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _err("'text' must be an object", "text")
    verbosity = raw.get("verbosity")
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise _err("'verbosity' must be low, medium or high", "text.verbosity")
    fmt = raw.get("format")
    echo: dict[str, Any] = {"format": {"type": "text"}, "verbosity": verbosity or "medium"}
    if fmt is None:
        return echo, None
    if not isinstance(fmt, dict):
        raise _err("'text.format' must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return echo, None
    if kind == "json_object":
        echo["format"] = {"type": "json_object"}
        return echo, {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _err("a json_schema format needs a 'schema' object", "text.format.schema")
        name = fmt.get("name", "response")
        if not isinstance(name, str) or not name:
            raise _err("'name' must be a non-empty string", "text.format.name")
        strict = fmt.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _err("'strict' must be a boolean", "text.format.strict")
        desc = fmt.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _err("'description' must be a string", "text.format.description")
        echo["format"] = {"type": "json_schema", "name": name, "schema": schema,
                          "strict": bool(strict), "description": desc}
        return echo, {"type": "json_schema",
                      "json_schema": {"name": name, "schema": schema, "strict": bool(strict)}}
    raise _err("text.format type must be text, json_object or json_schema", "text.format.type")


def _reasoning(raw: Any) -> tuple[dict[str, Any], str | None]:
    """(the echoed ``reasoning``, the chat ``reasoning_effort``)."""
    if raw is None:
        return {"effort": None, "summary": None}, None
    if not isinstance(raw, dict):
        raise _err("'reasoning' must be an object", "reasoning")
    effort = raw.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise _err(f"'effort' must be one of {', '.join(EFFORTS)}", "reasoning.effort")
    summary = raw.get("summary")
    if summary is None:
        summary = raw.get("generate_summary")
    if summary is not None and summary not in SUMMARIES:
        raise _err(f"'summary' must be one of {', '.join(SUMMARIES)}", "reasoning.summary")
    chat_effort = "high" if effort in ("xhigh", "max") else effort
    return {"effort": effort, "summary": summary}, chat_effort


def _renamed(exc: RequestError) -> RequestError:
    """A chat validation error with the Responses body's parameter names."""
    param = exc.param
    if param is not None:
        for old, new in _RENAMED:
            if param == old or param.startswith((old + ".", old + "[")):
                param = new + param[len(old):]
                break
    message = exc.message
    for old, new in _RENAMED[:1] + _RENAMED[3:4]:
        message = message.replace(f"'{old}'", f"'{new}'")
    return type(exc)(message, param=param, code=exc.code, status=exc.status)


def parse(body: Any, *, previous: Callable[[str], StoredResponse | None] | None = None) -> ResponsesCall:
    """Validate a Responses body (raises :class:`RequestError`).

    ``previous`` finds a stored response by id (``ResponseStore.get``) for
    ``previous_response_id``; without it, or when it finds nothing, a
    ``previous_response_id`` is OpenAI's 404 ``previous_response_not_found``.
    """
    if not isinstance(body, dict):
        raise _err("the request body must be a JSON object", "body")
    _unsupported(body)
    model = _opt_str(body, "model")
    instructions = _opt_str(body, "instructions")
    if instructions is not None:
        _valid_text(instructions, "instructions")
    stream = _flag(body, "stream", False)
    store = _flag(body, "store", True)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(
            opts.get("include_obfuscation", False), bool)):
        raise _err("'stream_options' must be an object ({'include_obfuscation': bool})",
                   "stream_options")
    metadata = _metadata(body.get("metadata"))
    prev_id = _opt_str(body, "previous_response_id")
    history: tuple[dict[str, Any], ...] = ()
    if prev_id is not None:
        found = previous(prev_id) if previous is not None else None
        if found is None:
            raise RequestError(f"Previous response with id '{prev_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found",
                               status=404)
        history = found.conversation
    items = _input_items(body.get("input"))
    tools_echo, chat_tools = _tools(body.get("tools"))
    choice_echo, chat_choice, chat_tools = _tool_choice(body.get("tool_choice"), chat_tools)
    parallel = _flag(body, "parallel_tool_calls", True)
    text_echo, response_format = _text(body.get("text"))
    reasoning_echo, effort = _reasoning(body.get("reasoning"))
    max_output = _count(body, "max_output_tokens", 1, MAX_INT)
    max_tool_calls = _count(body, "max_tool_calls", 1, MAX_INT)
    top_logprobs = _count(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    logprobs = LOGPROBS_INCLUDE in _include(body.get("include")) or top_logprobs > 0
    truncation = body.get("truncation")
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise _err("'truncation' must be auto or disabled", "truncation")
    strings = {k: _opt_str(body, k) for k in ("user", "safety_identifier", "prompt_cache_key",
                                              "service_tier")}
    messages = to_messages(history + items, instructions=instructions, first_new=len(history))
    chat_body: dict[str, Any] = {"messages": messages, "model": model, "stream": stream,
                                 "parallel_tool_calls": parallel,
                                 "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                                 "max_tokens": max_output, "logprobs": logprobs,
                                 "top_logprobs": top_logprobs, "reasoning_effort": effort}
    if chat_tools:
        chat_body["tools"] = chat_tools
    if chat_choice is not None:
        chat_body["tool_choice"] = chat_choice
    if response_format is not None:
        chat_body["response_format"] = response_format
    try:
        chat = ChatRequest.from_openai(chat_body)
    except RequestError as exc:
        raise _renamed(exc) from None
    settings = (
        ("instructions", instructions), ("max_output_tokens", max_output),
        ("max_tool_calls", max_tool_calls), ("parallel_tool_calls", parallel),
        ("previous_response_id", prev_id), ("reasoning", reasoning_echo),
        ("service_tier", strings["service_tier"] or "default"), ("store", store),
        ("temperature", chat.temperature), ("text", text_echo), ("tool_choice", choice_echo),
        ("tools", tools_echo), ("top_logprobs", top_logprobs), ("top_p", chat.top_p),
        ("truncation", truncation or "disabled"), ("user", strings["user"]),
        ("safety_identifier", strings["safety_identifier"]),
        ("prompt_cache_key", strings["prompt_cache_key"]), ("metadata", metadata),
    )
    return ResponsesCall(chat=chat, input_items=items, history=history, settings=settings,
                         stream=stream, store=store, logprobs=logprobs)


# -- events ------------------------------------------------------------------------


def _clamp(value: float) -> float:
    if value >= MIN_LOGPROB:  # False for NaN too
        return value if value <= 0.0 else 0.0
    return MIN_LOGPROB


def _logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "token": entry.token,
        "bytes": list(entry.bytes) if entry.bytes is not None else [],
        "logprob": _clamp(entry.logprob),
        "top_logprobs": [{"token": t.token, "bytes": list(t.bytes) if t.bytes is not None else [],
                          "logprob": _clamp(t.logprob)} for t in entry.top_logprobs],
    }


class _Item:
    """One output item while it streams."""

    __slots__ = ("call_id", "id", "index", "kind", "logprobs", "name", "parts", "status")

    def __init__(self, kind: str, id: str, index: int, *, call_id: str = "", name: str = "") -> None:
        self.kind = kind
        self.id = id
        self.index = index
        self.call_id = call_id
        self.name = name
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.status = "in_progress"

    @property
    def done(self) -> bool:
        return self.status != "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "summary_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [],
                "logprobs": list(self.logprobs)}

    def to_dict(self) -> dict[str, Any]:
        status = self.status
        if self.kind == "reasoning":
            summary = [self.part()] if self.parts or self.done else []
            return {"id": self.id, "type": "reasoning", "summary": summary, "status": status}
        if self.kind == "message":
            content = [self.part()] if self.parts or self.done else []
            return {"id": self.id, "type": "message", "status": status, "role": "assistant",
                    "content": content}
        return {"id": self.id, "type": "function_call", "status": status, "arguments": self.text,
                "call_id": self.call_id, "name": self.name}


class ResponseWriter:
    """Turn one engine stream's events into Responses events and the Response object.

    :meth:`start` gives ``response.created`` and ``response.in_progress``;
    :meth:`feed` the events for the engine's next events (one step or
    several); the terminal event comes with the ``Usage`` after the
    ``Finish``, or from :meth:`end` (the stream ended: a finish without usage
    completes, no finish fails), :meth:`fail` (an error outside the stream)
    or :meth:`abort` (the client left: status ``cancelled``, no event needed).
    :attr:`response` is the Response object at any moment.
    """

    def __init__(self, call: ResponsesCall, *, id: str, created_at: float, model: str,
                 clock: Callable[[], float] = time.time,
                 ids: Callable[[str], str] = new_id) -> None:
        self.call = call
        self.id = id
        self.created_at = created_at
        self.model = model
        self._clock = clock
        self._ids = ids
        self._seq = 0
        self._started = False
        self._items: list[_Item] = []
        self._reasoning: _Item | None = None
        self._message: _Item | None = None
        self._calls: dict[int, _Item] = {}
        self._finish: str | None = None
        self._usage: Usage | None = None
        self._lp_pending: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        self.completed_at: float | None = None
        self.reasoning_tokens: int | None = None
        """Set before the finish to report ``output_tokens_details.reasoning_tokens``."""

    # -- state ---------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The response reached a terminal status (nothing more will be emitted)."""
        return self.status != "in_progress"

    @property
    def reasoning_text(self) -> str:
        """Every reasoning item's text so far."""
        return "".join(i.text for i in self._items if i.kind == "reasoning")

    @property
    def response(self) -> dict[str, Any]:
        """The Response object now (``in_progress`` until the end)."""
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "background": False, "error": self.error,
            "incomplete_details": self.incomplete_details, "model": self.model,
            "output": [item.to_dict() for item in self._items],
        }
        out.update(self.call.settings)
        out["usage"] = self._usage_dict()
        out["completed_at"] = self.completed_at
        return out

    def stored(self) -> StoredResponse:
        """What ``store: true`` keeps once the response is done."""
        return StoredResponse(response=self.response, input_items=self.call.conversation)

    def _usage_dict(self) -> dict[str, Any] | None:
        u = self._usage
        if u is None:
            return None
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(self.reasoning_tokens or 0,
                                                              u.completion_tokens)},
            "total_tokens": u.total_tokens,
        }

    def _event(self, out: list[dict[str, Any]], type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type, **fields, "sequence_number": self._seq}
        self._seq += 1
        out.append(event)
        return event

    # -- the stream ----------------------------------------------------------------

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress`` (once)."""
        out: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            self._event(out, "response.created", response=self.response)
            self._event(out, "response.in_progress", response=self.response)
        return out

    def feed(self, events: Iterable[Event]) -> list[dict[str, Any]]:
        """The Responses events for the engine's next events."""
        out = self.start()
        if self.done:
            return out
        # a token's LogprobsDelta follows the events its text made: a text delta
        # (it joins it), reasoning or tool-call markup (dropped) or nothing yet
        # (held back: it joins the next text delta)
        last: dict[str, Any] | None = None
        prev: type | None = None
        for event in events:
            kind = type(event)
            if kind is ContentDelta:
                last = self._content(event.text, out) or last  # type: ignore[union-attr]
            elif kind is LogprobsDelta:
                if prev in (ContentDelta, LogprobsDelta, None):
                    self._logprobs(event, last if prev is ContentDelta else None)  # type: ignore[arg-type]
            elif kind is ReasoningDelta:
                self._lp_pending = []
                self._reason(event.text, out)  # type: ignore[union-attr]
            elif kind is ToolCallDelta:
                self._lp_pending = []
                self._tool(event, out)  # type: ignore[arg-type]
            elif kind is Finish:
                self._finish = event.reason  # type: ignore[union-attr]
            elif kind is Usage:
                self._usage = event  # type: ignore[assignment]
                if self._finish is not None:
                    out += self._terminal(self._finish)
                    break
            elif kind is StreamFailure:
                out += self.fail(event.message, type=event.type)  # type: ignore[union-attr]
                break
            prev = kind
        return out

    def end(self) -> list[dict[str, Any]]:
        """The stream has no more events: finish it if it is not done."""
        out = self.start()
        if self.done:
            return out
        if self._finish is not None:
            return out + self._terminal(self._finish)
        return out + self.fail("the stream ended before it finished")

    def fail(self, message: str, *, type: str = "server_error") -> list[dict[str, Any]]:
        """End the response ``failed`` with ``message`` (``response.failed``)."""
        out = self.start()
        if self.done:
            return out
        self._close_all("incomplete", out)
        self.status = "failed"
        self.error = {"code": "server_error", "message": message, "type": type}
        self._event(out, "response.failed", response=self.response)
        return out

    def abort(self) -> None:
        """The client left before the end: status ``cancelled``, nothing to send."""
        if not self.done:
            self._close_all("incomplete", [])
            self.status = "cancelled"

    # -- items ---------------------------------------------------------------------

    def _open(self, kind: str, prefix: str, out: list[dict[str, Any]], **kw: str) -> _Item:
        item = _Item(kind, self._ids(prefix), len(self._items), **kw)
        self._items.append(item)
        self._event(out, "response.output_item.added", output_index=item.index,
                    item=item.to_dict())
        if kind == "reasoning":
            self._event(out, "response.reasoning_summary_part.added", item_id=item.id,
                        output_index=item.index, summary_index=0, part=item.part())
        elif kind == "message":
            self._event(out, "response.content_part.added", item_id=item.id,
                        output_index=item.index, content_index=0, part=item.part())
        return item

    def _close(self, item: _Item, status: str, out: list[dict[str, Any]]) -> None:
        ids = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            self._event(out, "response.reasoning_summary_text.done", **ids, summary_index=0,
                        text=item.text)
            self._event(out, "response.reasoning_summary_part.done", **ids, summary_index=0,
                        part=item.part())
            self._reasoning = None
        elif item.kind == "message":
            if self._lp_pending:
                item.logprobs += self._lp_pending
                self._lp_pending = []
            self._event(out, "response.output_text.done", **ids, content_index=0, text=item.text,
                        logprobs=list(item.logprobs))
            self._event(out, "response.content_part.done", **ids, content_index=0,
                        part=item.part())
            self._message = None
        else:
            self._event(out, "response.function_call_arguments.done", **ids, arguments=item.text)
        item.status = status
        self._event(out, "response.output_item.done", output_index=item.index,
                    item=item.to_dict())

    def _close_all(self, status: str, out: list[dict[str, Any]]) -> None:
        for item in self._items:
            if not item.done:
                self._close(item, status, out)

    def _content(self, text: str, out: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not text:
            return None
        item = self._message
        if item is None:
            if self._reasoning is not None:
                self._close(self._reasoning, "completed", out)
            item = self._message = self._open("message", "msg", out)
        item.parts.append(text)
        logprobs, self._lp_pending = self._lp_pending, []
        item.logprobs += logprobs
        return self._event(out, "response.output_text.delta", item_id=item.id,
                           output_index=item.index, content_index=0, delta=text, logprobs=logprobs)

    def _logprobs(self, event: LogprobsDelta, last: dict[str, Any] | None) -> None:
        if not self.call.logprobs:
            return
        entries = [_logprob(e) for e in event.content]
        if last is not None and self._message is not None:
            last["logprobs"] = last["logprobs"] + entries
            self._message.logprobs += entries
        else:  # a token whose text is still held back: it joins the next text delta
            self._lp_pending += entries

    def _reason(self, text: str, out: list[dict[str, Any]]) -> None:
        if not text:
            return
        item = self._reasoning
        if item is None:
            if self._message is not None:
                self._close(self._message, "completed", out)
            item = self._reasoning = self._open("reasoning", "rs", out)
        item.parts.append(text)
        self._event(out, "response.reasoning_summary_text.delta", item_id=item.id,
                    output_index=item.index, summary_index=0, delta=text)

    def _tool(self, event: ToolCallDelta, out: list[dict[str, Any]]) -> None:
        item = self._calls.get(event.index)
        if item is None:
            for other in (self._reasoning, self._message):
                if other is not None:
                    self._close(other, "completed", out)
            item = self._open("function_call", "fc", out, call_id=event.id or self._ids("call"),
                              name=event.name or "")
            self._calls[event.index] = item
        if event.arguments:
            item.parts.append(event.arguments)
            self._event(out, "response.function_call_arguments.delta", item_id=item.id,
                        output_index=item.index, delta=event.arguments)

    def _terminal(self, reason: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reason in ("stop", "tool_calls"):
            if not self._items:  # an empty answer is an empty message, as output_text ""
                self._open("message", "msg", out)
            self._close_all("completed", out)
            self.status = "completed"
            self.completed_at = self._clock()
            self._event(out, "response.completed", response=self.response)
            return out
        self._close_all("incomplete", out)
        if reason == "cancelled":
            self.status = "cancelled"
        else:  # "length": max_output_tokens (or the context) ran out
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
        self._event(out, "response.incomplete", response=self.response)
        return out


def encode(events: Iterable[dict[str, Any]]) -> bytes:
    """SSE frames ``event: TYPE`` / ``data: {...}`` for Responses events."""
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + dumps(e) + b"\n\n"
                    for e in events)
