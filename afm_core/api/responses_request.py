"""The request half of the Responses translation: a Responses body into a
:class:`ResponsesCall` (the engine's ``ChatRequest`` and what the Response
object echoes).  Import it from :mod:`afm_core.api.responses`, which documents
what is accepted, what is refused and how items become chat turns.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard
library.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from .._errors import RequestError, UnsupportedError
from ._hosted import OPENAI_SKIPPED, joined
from ._validate import count, err, flag, json_object, optional_str, valid_text
from .chat_request import MAX_INT, MAX_TOP_LOGPROBS, ChatRequest
from .responses_store import StoredResponse

__all__ = ["ResponsesCall", "decode_summary", "encode_summary", "new_id", "parse", "to_messages"]

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SUMMARIES = ("auto", "concise", "detailed")
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image_url", "image", "file")
MAX_METADATA = 16
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# item types of hosted tools and other features afm does not run
UNSUPPORTED_ITEMS = frozenset({
    "item_reference", "file_search_call", "web_search_call", "computer_call", "computer_call_output",
    "image_generation_call", "code_interpreter_call", "local_shell_call", "local_shell_call_output",
    "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output", "mcp_call",
    "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "custom_tool_call",
    "custom_tool_call_output", "tool_search_call", "tool_search_output", "program",
    "program_output", "additional_tools",
})
COMPACTION_TAG = "afm-compaction-v1:"
"""How the ``encrypted_content`` of afm's compaction items begins (the summary follows, base64)."""
SUMMARY_PROMPT = (
    "Pause the task here: your context is about to be cleared, and another assistant "
    "will continue from a summary you write now. Write that summary. Include the user's "
    "goal and every requirement or preference they stated; what has been done so far "
    "(commands run, files read or changed, decisions made and why); what was found; what "
    "remains to be done, in order; and any exact names, paths, values or errors the next "
    "assistant will need. Be concise and factual, and do not call any tools."
)
"""The user message appended to a conversation to ask the served model for its summary
(``/v1/responses/compact``, a ``compaction_trigger`` input item)."""
COMPACTED_HEADER = ("[The earlier part of this conversation was compacted. A summary of it "
                    "follows; continue the work from there.]\n\n")
"""What precedes a compaction item's summary in the prompt (a user turn)."""
# chat-body parameter names as the Responses body spells them
_RENAMED = (("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"), ("reasoning_effort", "reasoning.effort"),
            ("messages", "input"))


def new_id(prefix: str) -> str:
    """A fresh id like OpenAI's: ``prefix``, ``_`` and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


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
    compaction: bool = False
    """The input ended with a ``compaction_trigger``: the model writes a summary, which
    the response's one output item (``compaction``) carries."""
    namespaced: tuple[tuple[str, str, str], ...] = ()
    """Each function of a ``namespace`` tool: (the name offered to the model, its
    namespace, its own name); a call to it goes out with ``name`` and ``namespace``."""

    def tool_name(self, offered: str) -> tuple[str, str | None]:
        """``(name, namespace)`` of the tool the model called as ``offered``."""
        for flat, space, name in self.namespaced:
            if flat == offered:
                return name, space
        return offered, None

    @property
    def n(self) -> int:
        """The choices asked for (afm's ``n`` extension; the engine runs one
        stream per :meth:`ChatRequest.per_choice` request)."""
        return self.chat.n

    @property
    def conversation(self) -> tuple[dict[str, Any], ...]:
        """The items the response is generated from (what it stores as its input)."""
        return self.history + self.input_items


def _unsupported(body: dict[str, Any]) -> None:
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise err("'background' must be a boolean", "background")
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
        raise err(f"'metadata' must be an object of at most {MAX_METADATA} pairs", "metadata")
    for k, v in raw.items():
        if not isinstance(k, str) or len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise err("metadata keys must be strings of at most 64 characters, values strings "
                       "of at most 512", "metadata")
        valid_text(k, "metadata")
        valid_text(v, "metadata")
    return dict(raw)


def _include(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise err("'include' must be an array of strings", "include")
    return tuple(raw)


# -- input items -------------------------------------------------------------------


def _parts_text(content: Any, param: str, *, role: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return valid_text(content, param)
    if not isinstance(content, list):
        raise err("message content must be a string or an array of content parts", param)
    out = []
    for i, part in enumerate(content):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise err("content parts must be objects", p)
        kind = part.get("type")
        key = "refusal" if kind == "refusal" and role == "assistant" else "text"
        if kind in TEXT_PARTS or key == "refusal":
            text = part.get(key)
            if not isinstance(text, str):
                raise err(f"a {kind} part needs a string '{key}'", f"{p}.{key}")
            out.append(text)
        elif kind in MEDIA_PARTS:
            raise UnsupportedError(f"content part type '{kind}' is not supported by this model "
                                   "(text only)", param=f"{p}.type")
        else:
            raise err(f"unknown content part type {kind!r}", f"{p}.type")
    return valid_text("".join(out), param)


def encode_summary(summary: str) -> str:
    """A compaction summary as a compaction item's ``encrypted_content``."""
    return COMPACTION_TAG + base64.b64encode(summary.encode()).decode("ascii")


def decode_summary(content: str, param: str = "encrypted_content") -> str:
    """The summary in a compaction item's ``encrypted_content`` (a 400 unless afm wrote it)."""
    if not content.startswith(COMPACTION_TAG):
        raise err("this compaction item was not made by this server (its encrypted_content "
                  "is not afm's): compact the conversation with this server's "
                  "/v1/responses/compact, or send the items themselves", param)
    try:
        return base64.b64decode(content[len(COMPACTION_TAG):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise err("a compaction item's encrypted_content is damaged", param) from None


def _item_id(item: dict[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else new_id(prefix)


def _required_str(item: dict[str, Any], key: str, param: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise err(f"'{key}' must be a non-empty string", f"{param}.{key}")
    return valid_text(v, f"{param}.{key}")


def _message_item(item: dict[str, Any], p: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise err(f"a message's role must be one of {', '.join(INPUT_ROLES)}", f"{p}.role")
    if "content" not in item:
        raise err("a message needs 'content'", f"{p}.content")
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
            raise err(f"a reasoning item's '{key}' must be an array", f"{p}.{key}")
        parts = []
        for i, part in enumerate(raw):
            if not isinstance(part, dict) or part.get("type") != kind \
                    or not isinstance(part.get("text"), str):
                raise err(f"each {key} part must be {{'type': '{kind}', 'text': ...}}",
                           f"{p}.{key}[{i}]")
            parts.append({"type": kind, "text": valid_text(part["text"], f"{p}.{key}[{i}]")})
        out[key] = parts
    return out


def _output_text(raw: Any, p: str) -> str:
    if isinstance(raw, str):
        return valid_text(raw, p)
    if isinstance(raw, list):
        return _parts_text(raw, p, role="tool")
    raise err("a function call output must be a string or an array of text parts", p)


def _input_item(item: Any, p: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise err("each input item must be an object", p)
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"
    if kind == "message":
        return _message_item(item, p)
    if kind == "function_call":
        args = item.get("arguments")
        if not isinstance(args, str):
            raise err("'arguments' must be a JSON string", f"{p}.arguments")
        out = {"id": _item_id(item, "fc"), "type": "function_call",
               "call_id": _required_str(item, "call_id", p), "name": _required_str(item, "name", p),
               "arguments": valid_text(args, f"{p}.arguments"), "status": "completed"}
        if item.get("namespace") is not None:  # a call to a tool of a namespace tool
            out["namespace"] = _required_str(item, "namespace", p)
        return out
    if kind == "function_call_output":
        if "output" not in item:
            raise err("a function call output needs 'output'", f"{p}.output")
        return {"id": _item_id(item, "fco"), "type": "function_call_output",
                "call_id": _required_str(item, "call_id", p),
                "output": _output_text(item["output"], f"{p}.output"), "status": "completed"}
    if kind == "reasoning":
        return _reasoning_item(item, p)
    if kind == "compaction_trigger":
        return {"id": _item_id(item, "ctr"), "type": "compaction_trigger"}
    if kind == "compaction":
        content = _required_str(item, "encrypted_content", p)
        valid_text(decode_summary(content, f"{p}.encrypted_content"), f"{p}.encrypted_content")
        return {"id": _item_id(item, "cmp"), "type": "compaction", "encrypted_content": content}
    if isinstance(kind, str) and kind in UNSUPPORTED_ITEMS:
        raise UnsupportedError(f"input items of type '{kind}' are not supported: afm runs "
                               "function tools only (send items themselves, not references)",
                               param=f"{p}.type")
    raise err(f"unknown input item type {kind!r}", f"{p}.type")


def _input_items(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        raise err("'input' is required", "input")
    if isinstance(raw, str):
        text = valid_text(raw, "input")
        return ({"id": new_id("msg"), "type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": text}], "status": "completed"},)
    if not isinstance(raw, list) or not raw:
        raise err("'input' must be a string or a non-empty array of input items", "input")
    items = tuple(_input_item(item, f"input[{i}]") for i, item in enumerate(raw))
    for i, item in enumerate(items[:-1]):
        if item["type"] == "compaction_trigger":
            raise err("a compaction_trigger must be the final input item", f"input[{i}].type")
    return items


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
            name = item["name"] if not item.get("namespace") else joined(item["namespace"], item["name"])
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": name, "arguments": item["arguments"]}})
        elif kind == "compaction":
            flush()
            out.append({"role": "user",
                        "content": COMPACTED_HEADER + decode_summary(item["encrypted_content"])})
        elif kind == "function_call_output":
            flush()
            if item["call_id"] not in call_ids:
                raise err(f"No tool call found for function call output with call_id "
                           f"{item['call_id']!r}.", f"input[{max(i - first_new, 0)}].call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            flush()
            out.append({"role": item["role"], "content": _item_text(item)})
    flush()
    return out


# -- tools, formats, reasoning ----------------------------------------------------------


def _tools(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], tuple[str, ...],
                               tuple[tuple[str, str, str], ...]]:
    """(the tools as the Response echoes them, the chat body's tools, the skipped tool
    types, and each namespaced function as ``(offered name, namespace, name)``)."""
    if raw is None:
        return [], [], (), ()
    if not isinstance(raw, list):
        raise err("'tools' must be an array", "tools")
    echo: list[dict[str, Any]] = []
    chat: list[dict[str, Any]] = []
    skipped: list[str] = []
    spaced: list[tuple[str, str, str]] = []
    names: set[str] = set()
    for i, t in enumerate(raw):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise err("each tool must be an object", p)
        kind = t.get("type")
        if kind == "function":
            e, c = _function_tool(t, p, names)
            echo.append(e)
            chat.append(c)
        elif kind == "namespace":
            space = t.get("name")
            if not isinstance(space, str) or not 1 <= len(space) <= 128:
                raise err("a namespace tool needs a 'name' (1-128 characters)", f"{p}.name")
            valid_text(space, f"{p}.name")
            inner = t.get("tools")
            if not isinstance(inner, list):
                raise err("a namespace tool needs a 'tools' array", f"{p}.tools")
            desc = t.get("description")
            if desc is not None and not isinstance(desc, str):
                raise err("'description' must be a string", f"{p}.description")
            members: list[dict[str, Any]] = []
            for j, member in enumerate(inner):
                q = f"{p}.tools[{j}]"
                if not isinstance(member, dict):
                    raise err("each tool must be an object", q)
                if member.get("type") != "function":
                    if member.get("type") in OPENAI_SKIPPED:
                        skipped.append(f"{space}.{member.get('name') or member['type']}")
                        continue
                    raise err("a namespace holds function tools ('type': 'function')", f"{q}.type")
                e, c = _function_tool(member, q, names, space)
                members.append(e)
                chat.append(c)
                spaced.append((c["function"]["name"], space, e["name"]))
            echo.append({"type": "namespace", "name": space, "description": desc or "",
                         "tools": members})
        elif kind in OPENAI_SKIPPED:
            echo.append(dict(t))  # echoed as sent: the Response lists what the request had
            skipped.append(kind)
        elif isinstance(kind, str) and kind:
            raise UnsupportedError(f"tool type '{kind}' is not supported: afm runs function "
                                   "tools (and skips the hosted ones)", param=f"{p}.type")
        else:
            raise err("each tool needs a 'type' ('function')", f"{p}.type")
    return echo, chat, tuple(dict.fromkeys(skipped)), tuple(spaced)


def _function_tool(t: dict[str, Any], p: str, names: set[str],
                   space: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the echoed function tool, the chat tool); in a namespace, offered as ``space__name``."""
    name = t.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 256:
        raise err("a function tool needs a 'name' (1-256 characters)", f"{p}.name")
    valid_text(name, f"{p}.name")
    offered = name if space is None else joined(space, name)
    if offered in names:
        raise err(f"duplicate tool name {offered!r}", f"{p}.name")
    names.add(offered)
    params = t.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise err("'parameters' must be a JSON schema object", f"{p}.parameters")
    desc = t.get("description")
    if desc is not None and not isinstance(desc, str):
        raise err("'description' must be a string", f"{p}.description")
    strict = t.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise err("'strict' must be a boolean", f"{p}.strict")
    echo = {"type": "function", "name": name, "description": desc, "parameters": params,
            "strict": bool(strict)}
    fn: dict[str, Any] = {"name": offered, "parameters": params}
    if desc is not None:
        fn["description"] = desc
    if strict:
        fn["strict"] = True
    return echo, {"type": "function", "function": fn}


def _tool_choice(raw: Any, chat_tools: list[dict[str, Any]]) -> tuple[Any, Any, list[dict[str, Any]]]:
    """(the echoed tool_choice, the chat tool_choice, the chat tools it leaves)."""
    names = [t["function"]["name"] for t in chat_tools]
    if raw is None:
        return "auto", None, chat_tools
    if raw in ("auto", "none", "required"):
        if raw == "required" and not chat_tools:
            raise err("tool_choice 'required' needs tools", "tool_choice")
        return raw, raw if chat_tools else None, chat_tools
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "function":
            name = _offered(raw)
            if not isinstance(name, str) or name not in names:
                raise err(f"tool_choice names an unknown function {name!r}", "tool_choice.name")
            echo = {k: raw[k] for k in ("type", "name", "namespace") if raw.get(k) is not None}
            return echo, {"type": "function", "function": {"name": name}}, chat_tools
        if kind == "allowed_tools":
            mode = raw.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise err("allowed_tools 'mode' must be auto or required", "tool_choice.mode")
            allowed = raw.get("tools")
            if not isinstance(allowed, list) or not allowed:
                raise err("allowed_tools needs a non-empty 'tools' array", "tool_choice.tools")
            keep: list[str] = []
            for i, t in enumerate(allowed):
                p = f"tool_choice.tools[{i}]"
                if not isinstance(t, dict) or t.get("type") != "function":
                    raise UnsupportedError("allowed_tools may list function tools only", param=p)
                if _offered(t) not in names:
                    raise err(f"allowed_tools names an unknown function {t.get('name')!r}",
                               f"{p}.name")
                keep.append(_offered(t))
            subset = [t for t in chat_tools if t["function"]["name"] in keep]
            echo = {"type": "allowed_tools", "mode": mode,
                    "tools": [{k: t[k] for k in ("type", "name", "namespace") if t.get(k) is not None}
                              for t in allowed]}
            return echo, mode, subset
        if kind in OPENAI_SKIPPED:  # a skipped tool cannot be forced: the model chooses
            return dict(raw), "auto" if chat_tools else None, chat_tools
        if isinstance(kind, str) and kind:
            raise UnsupportedError(f"tool_choice type '{kind}' is not supported: afm runs function "
                                   "tools only", param="tool_choice.type")
    raise err("'tool_choice' must be auto, none, required, a function or allowed_tools",
               "tool_choice")


def _offered(choice: dict[str, Any]) -> Any:
    """The function name a tool_choice entry names (``namespace__name`` with a namespace)."""
    name, space = choice.get("name"), choice.get("namespace")
    if isinstance(name, str) and isinstance(space, str) and space:
        return joined(space, name)
    return name


def _text(raw: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the echoed ``text``, the chat ``response_format``)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise err("'text' must be an object", "text")
    verbosity = raw.get("verbosity")
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise err("'verbosity' must be low, medium or high", "text.verbosity")
    fmt = raw.get("format")
    echo: dict[str, Any] = {"format": {"type": "text"}, "verbosity": verbosity or "medium"}
    if fmt is None:
        return echo, None
    if not isinstance(fmt, dict):
        raise err("'text.format' must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return echo, None
    if kind == "json_object":
        echo["format"] = {"type": "json_object"}
        return echo, {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise err("a json_schema format needs a 'schema' object", "text.format.schema")
        name = fmt.get("name", "response")
        if not isinstance(name, str) or not name:
            raise err("'name' must be a non-empty string", "text.format.name")
        strict = fmt.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise err("'strict' must be a boolean", "text.format.strict")
        desc = fmt.get("description")
        if desc is not None and not isinstance(desc, str):
            raise err("'description' must be a string", "text.format.description")
        echo["format"] = {"type": "json_schema", "name": name, "schema": schema,
                          "strict": bool(strict), "description": desc}
        return echo, {"type": "json_schema",
                      "json_schema": {"name": name, "schema": schema, "strict": bool(strict)}}
    raise err("text.format type must be text, json_object or json_schema", "text.format.type")


def _reasoning(raw: Any) -> tuple[dict[str, Any], str | None]:
    """(the echoed ``reasoning``, the chat ``reasoning_effort``)."""
    if raw is None:
        return {"effort": None, "summary": None}, None
    if not isinstance(raw, dict):
        raise err("'reasoning' must be an object", "reasoning")
    effort = raw.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise err(f"'effort' must be one of {', '.join(EFFORTS)}", "reasoning.effort")
    summary = raw.get("summary")
    if summary is None:
        summary = raw.get("generate_summary")
    if summary is not None and summary not in SUMMARIES:
        raise err(f"'summary' must be one of {', '.join(SUMMARIES)}", "reasoning.summary")
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
    body = json_object(body)
    _unsupported(body)
    model = optional_str(body, "model")
    instructions = optional_str(body, "instructions")
    if instructions is not None:
        valid_text(instructions, "instructions")
    stream = flag(body, "stream", False)
    store = flag(body, "store", True)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(
            opts.get("include_obfuscation", False), bool)):
        raise err("'stream_options' must be an object ({'include_obfuscation': bool})",
                   "stream_options")
    metadata = _metadata(body.get("metadata"))
    prev_id = optional_str(body, "previous_response_id")
    history: tuple[dict[str, Any], ...] = ()
    if prev_id is not None:
        found = previous(prev_id) if previous is not None else None
        if found is None:
            raise RequestError(f"Previous response with id '{prev_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found",
                               status=404)
        if found.choices > 1:
            # each choice is its own assistant turn: which one the conversation went on with
            # is the client's choice, not something to guess
            raise RequestError(f"Previous response '{prev_id}' has {found.choices} choices (n = "
                               f"{found.choices}), so which one to continue from cannot be "
                               "inferred: send that choice's output items (their choice_index "
                               "tells them apart) as input instead of previous_response_id.",
                               param="previous_response_id", code="previous_response_has_choices")
        history = found.conversation
    items = _input_items(body.get("input"))
    compaction = items[-1]["type"] == "compaction_trigger"
    if compaction:
        items = items[:-1]
        if not history + items:
            raise err("nothing to compact: the input has only a compaction_trigger", "input")
    tools_echo, chat_tools, skipped, spaced = _tools(body.get("tools"))
    choice_echo, chat_choice, chat_tools = _tool_choice(body.get("tool_choice"), chat_tools)
    parallel = flag(body, "parallel_tool_calls", True)
    text_echo, response_format = _text(body.get("text"))
    reasoning_echo, effort = _reasoning(body.get("reasoning"))
    max_output = count(body, "max_output_tokens", 1, MAX_INT, None)
    max_tool_calls = count(body, "max_tool_calls", 1, MAX_INT, None)
    top_logprobs = count(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None) or 0
    logprobs = LOGPROBS_INCLUDE in _include(body.get("include")) or top_logprobs > 0
    truncation = body.get("truncation")
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise err("'truncation' must be auto or disabled", "truncation")
    strings = {k: optional_str(body, k) for k in ("user", "safety_identifier", "prompt_cache_key",
                                              "service_tier")}
    messages = to_messages(history + items, instructions=instructions, first_new=len(history))
    if compaction:  # the summarising turn: no tools, no output format
        messages.append({"role": "user", "content": SUMMARY_PROMPT})
        chat_tools, chat_choice, response_format = [], None, None
    chat_body: dict[str, Any] = {"messages": messages, "model": model, "stream": stream,
                                 "n": body.get("n"),
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
    settings: tuple[tuple[str, Any], ...] = (
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
    if chat.n > 1:  # afm's extension, echoed only when used
        settings += (("n", chat.n),)
    if skipped:
        chat = replace(chat, skipped_tools=skipped)
    return ResponsesCall(chat=chat, input_items=items, history=history, settings=settings,
                         stream=stream, store=store, logprobs=logprobs, namespaced=spaced,
                         compaction=compaction)
