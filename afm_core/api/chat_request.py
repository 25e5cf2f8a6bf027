"""The Chat Completions request: an OpenAI chat body in, a frozen :class:`ChatRequest` out.

:class:`ChatRequest` is the engine's request for a conversation; OpenAI's
chat body is its native form, so the other translations (Anthropic Messages,
Responses, Ollama) build one through ``ChatRequest.from_openai`` too.

Sans-IO.  ``ChatRequest.from_openai(body)`` checks every field it accepts and
raises :class:`RequestError` (HTTP status hint and ``param``) for anything
malformed; unknown top-level fields are ignored like OpenAI's lenient clients
expect.  ``n`` (1 to :data:`MAX_N`) is the number of choices; the engine runs
one stream per choice (:meth:`ChatRequest.per_choice`).  The sampler settings
and stop strings (:func:`sampling`, :func:`seed_and_top_k`) are shared with
the raw-prompt :class:`~afm_core.api.completions_request.CompletionRequest`.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .._errors import UnsupportedError
from ._hosted import OPENAI_SKIPPED, joined
from ._validate import (
    err,
    flag,
    include_progress,
    include_usage,
    integer,
    json_object,
    number,
    optional_str,
    seed,
    valid_text,
)

__all__ = ["MAX_INT", "MAX_N", "MAX_STOP", "MAX_TOP_LOGPROBS", "ROLES", "ChatRequest", "adapter_field",
           "sampling", "seed_and_top_k"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_INT = 2**31 - 1
MAX_N = 16
"""The most choices (``n``) a request may ask for: a chat completion's, and each
prompt's in a completions body (a server may allow fewer: it runs every choice
as its own batch row)."""


def _text_content(content: Any, param: str, *, allow_none: bool) -> str | None:
    """Flatten OpenAI content (string or list of text parts) to a string."""
    if content is None:
        if allow_none:
            return None
        raise err("message content is required", param)
    if isinstance(content, str):
        return valid_text(content, param)
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            p = f"{param}[{i}]"
            if not isinstance(part, dict):
                raise err("content parts must be objects", p)
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise err("a text part needs a string 'text'", p)
                out.append(text)
            elif kind in ("image_url", "input_audio", "file", "image"):
                raise UnsupportedError(f"content part type '{kind}' is not supported by this model", param=p)
            else:
                raise err(f"unknown content part type {kind!r}", p)
        return valid_text("".join(out), param)
    raise err("message content must be a string or a list of parts", param)


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise err("'tool_calls' must be an array", param)
    out = []
    for i, call in enumerate(calls):
        p = f"{param}[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise err("a tool call needs a 'function' object", p)
        fn = call["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise err("a tool call needs a function name", f"{p}.function.name")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            raise err("tool call arguments must be a JSON string", f"{p}.function.arguments")
        valid_text(args, f"{p}.function.arguments")
        out.append(
            {
                "id": str(call.get("id") or f"call_{i}"),
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
        )
    return out


def _messages(raw: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list) or not raw:
        raise err("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise err("each message must be an object", p)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise err(f"unknown role {role!r}", f"{p}.role")
        if role == "developer":
            role = "system"
        if role == "function":
            role = "tool"
        msg: dict[str, Any] = {"role": role}
        has_calls = role == "assistant" and m.get("tool_calls")
        msg["content"] = _text_content(m.get("content"), f"{p}.content", allow_none=role == "assistant")
        if role == "assistant" and msg["content"] is None and not has_calls:
            msg["content"] = ""
        if has_calls:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{p}.tool_calls")
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if role == "assistant" and reasoning is not None:
            if not isinstance(reasoning, str):
                raise err("'reasoning_content' must be a string", f"{p}.reasoning_content")
            msg["reasoning_content"] = reasoning
        if role == "tool":
            tcid = m.get("tool_call_id")
            if tcid is not None and not isinstance(tcid, str):
                raise err("'tool_call_id' must be a string", f"{p}.tool_call_id")
            msg["tool_call_id"] = tcid
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise err("'name' must be a string", f"{p}.name")
            msg["name"] = name
        out.append(msg)
    return tuple(out)


def _tools(raw: Any) -> tuple[tuple[dict[str, Any], ...] | None, tuple[str, ...]]:
    """(the function tools, the skipped tool types).  A ``namespace`` tool (a group
    of function tools under a name, as Responses has them: Chat Completions has
    no such type, but clients translating from Responses send it) is flattened:
    each function is offered, and called, as ``<namespace>__<name>``
    (:func:`._hosted.joined`), since a chat tool call has no namespace field."""
    if raw is None:
        return None, ()
    if not isinstance(raw, list):
        raise err("'tools' must be an array", "tools")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    skipped: list[str] = []
    for i, t in enumerate(raw):
        p = f"tools[{i}]"
        if isinstance(t, dict) and t.get("type") in OPENAI_SKIPPED:
            skipped.append(t["type"])  # (custom tools, or a hosted type sent to chat)
            continue
        if isinstance(t, dict) and t.get("type") == "namespace":
            out += _namespace(t, p, names, skipped)
            continue
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise err("each tool must be {'type': 'function', 'function': {...}}", p)
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise err("a tool needs a 'function' object", f"{p}.function")
        out.append(_function(fn, f"{p}.function", names))
    return tuple(out) if out or not skipped else None, tuple(dict.fromkeys(skipped))


def _namespace(t: dict[str, Any], p: str, names: set[str], skipped: list[str]) -> list[dict[str, Any]]:
    """A namespace tool's functions, flattened (its members in the chat form, or
    in Responses' flat form ``{"type": "function", "name": ...}``)."""
    space = t.get("name")
    if not isinstance(space, str) or not 1 <= len(space) <= 128:
        raise err("a namespace tool needs a 'name' (1-128 characters)", f"{p}.name")
    members = t.get("tools")
    if not isinstance(members, list):
        raise err("a namespace tool needs a 'tools' array", f"{p}.tools")
    out = []
    for j, member in enumerate(members):
        q = f"{p}.tools[{j}]"
        if isinstance(member, dict) and member.get("type") in OPENAI_SKIPPED:
            skipped.append(f"{space}.{member.get('name') or member['type']}")
            continue
        if not isinstance(member, dict) or member.get("type", "function") != "function":
            raise err("a namespace holds function tools ('type': 'function')", q)
        fn = member.get("function")
        where = f"{q}.function" if isinstance(fn, dict) else q
        out.append(_function(fn if isinstance(fn, dict) else member, where, names, space))
    return out


def _function(fn: dict[str, Any], p: str, names: set[str], space: str | None = None) -> dict[str, Any]:
    """One function tool, validated, as the engine takes it (in a namespace:
    offered as ``space__name``)."""
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 256:
        raise err("a tool needs a function name (1-256 characters)", f"{p}.name")
    if space is not None:
        name = joined(space, name)
    if name in names:
        raise err(f"duplicate tool name {name!r}", f"{p}.name")
    names.add(name)
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise err("'parameters' must be a JSON schema object", f"{p}.parameters")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise err("'description' must be a string", f"{p}.description")
    strict = fn.get("strict", False)
    if not isinstance(strict, bool):
        raise err("'strict' must be a boolean", f"{p}.strict")
    entry: dict[str, Any] = {"name": name, "parameters": params}
    if desc is not None:
        entry["description"] = desc
    if strict:
        entry["strict"] = True
    return {"type": "function", "function": entry}


def _tool_choice(raw: Any, tools: tuple[dict[str, Any], ...] | None) -> str | dict[str, Any]:
    if raw is None:
        return "auto" if tools else "none"
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise err("'tool_choice' must be auto, none, required or a named function", "tool_choice")
        if raw == "required" and not tools:
            raise err("tool_choice 'required' needs tools", "tool_choice")
        return raw
    if isinstance(raw, dict) and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if not isinstance(name, str) or not tools or name not in {t["function"]["name"] for t in tools}:
            raise err(f"tool_choice names an unknown function {name!r}", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise err("'tool_choice' must be auto, none, required or a named function", "tool_choice")


def _response_format(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise err("'response_format' must be an object", "response_format")
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        js = raw.get("json_schema")
        if not isinstance(js, dict):
            raise err("'json_schema' must be an object", "response_format.json_schema")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise err("'schema' must be a JSON schema object", "response_format.json_schema.schema")
        name = js.get("name", "response")
        if not isinstance(name, str):
            raise err("'name' must be a string", "response_format.json_schema.name")
        strict = js.get("strict", False)
        if not isinstance(strict, bool):
            raise err("'strict' must be a boolean", "response_format.json_schema.strict")
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}
    raise err("response_format type must be text, json_object or json_schema", "response_format.type")


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or len(raw) > MAX_STOP:
        raise err(f"'stop' must be a string or up to {MAX_STOP} strings", "stop")
    for s in raw:
        if not isinstance(s, str) or not s:
            raise err("stop sequences must be non-empty strings", "stop")
    return tuple(raw)


def _logit_bias(raw: Any) -> dict[int, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > 1024:
        raise err("'logit_bias' must be an object of at most 1024 token ids", "logit_bias")
    out = {}
    for k, v in raw.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise err(f"logit_bias key {k!r} is not a token id", "logit_bias") from None
        if tid < 0 or isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100:
            raise err("logit_bias values must be numbers in [-100, 100]", "logit_bias")
        out[tid] = float(v)
    return out


def adapter_field(body: dict[str, Any]) -> str | None:
    """The body's ``adapters`` (mlx_lm.server's field): one adapter's name, or None."""
    v = body.get("adapters")
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
    if v is not None and (not isinstance(v, str) or not v):
        raise err("'adapters' must be the name of one adapter", "adapters")
    return v or None


def seed_and_top_k(body: dict[str, Any]) -> dict[str, Any]:
    """``seed`` and ``top_k`` of a chat or completions body (``top_k`` -1 or 0: off)."""
    s = seed(body)
    top_k = integer(body, "top_k", -1, 1_000_000, 0) or 0
    return {"seed": s, "top_k": max(top_k, 0)}


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampler settings and stop strings that chat and completions bodies share, validated in
    this order."""
    return {
        "temperature": number(body, "temperature", 0.0, 2.0, 1.0) or 0.0,
        "top_p": number(body, "top_p", 0.0, 1.0, 1.0) or 0.0,
        "min_p": number(body, "min_p", 0.0, 1.0, 0.0) or 0.0,
        "stop": _stop(body.get("stop")),
        "presence_penalty": number(body, "presence_penalty", -2.0, 2.0, 0.0) or 0.0,
        "frequency_penalty": number(body, "frequency_penalty", -2.0, 2.0, 0.0) or 0.0,
        "repetition_penalty": number(body, "repetition_penalty", 0.01, 10.0, 1.0) or 1.0,
        "logit_bias": _logit_bias(body.get("logit_bias")),
    }


@dataclass(frozen=True, slots=True)
class CacheBreakpoint:
    """A prompt-caching breakpoint (Anthropic's ``cache_control``): the prompt's
    prefix that the request's first ``messages`` messages (and the first
    ``tools`` tools; None: all) render to, with ``system`` (not None) as the
    first message's text, is pinned in the prefix cache for ``ttl`` seconds."""

    messages: int
    ttl: float = 300.0
    system: str | None = None
    tools: int | None = None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One validated chat completion request."""

    messages: tuple[dict[str, Any], ...]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    include_progress: bool = False
    """``stream_options.include_progress``: a streamed response carries prompt-progress
    chunks while the prompt is prefilled (the HTTP route opens the engine stream
    with ``progress=True``)."""
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None
    adapter: str | None = None
    """The LoRA adapter to run with, by its served name (``adapters`` in the
    body, as mlx_lm.server's); a ``model`` of the form ``base:name`` names
    one too (the engine resolves both: ``EngineConfig.adapters``)."""
    n: int = 1
    """Choices asked for.  The engine runs a request as one choice whatever its
    ``n``: open one stream per :meth:`per_choice` request (the HTTP layer does)."""
    skipped_tools: tuple[str, ...] = ()
    """The body's tools not offered to the model (hosted tools afm does not run:
    :mod:`afm_core.api._hosted`), by type; the ``X-AFM-Skipped-Tools`` header."""
    cache_breakpoints: tuple[CacheBreakpoint, ...] = ()
    """Prompt-caching breakpoints (the Messages API's ``cache_control``): their
    prefixes are pinned and counted as ``cache_creation_input_tokens``."""

    def per_choice(self) -> tuple[ChatRequest, ...]:
        """One request per choice (``n`` of them, each with ``n`` = 1).  With a
        ``seed``, choice ``j`` samples with ``seed + j``, so seeded choices differ
        and each is reproducible; unseeded ones differ by chance, greedy ones
        (``temperature`` 0) are equal."""
        one = replace(self, n=1) if self.n != 1 else self
        if self.seed is None:
            return (one,) * self.n
        return tuple(replace(one, seed=self.seed + j) if j else one for j in range(self.n))

    @classmethod
    def from_openai(cls, body: Any) -> ChatRequest:
        """Validate an OpenAI chat completion body."""
        body = json_object(body)
        model = optional_str(body, "model")
        n = integer(body, "n", 1, MAX_N, 1) or 1
        stream = flag(body, "stream", False)
        usage = include_usage(body)
        progress = include_progress(body)
        tools, skipped = _tools(body.get("tools"))
        max_tokens = integer(body, "max_completion_tokens", 1, MAX_INT, None)
        if max_tokens is None:
            max_tokens = integer(body, "max_tokens", 1, MAX_INT, None)
        logprobs = flag(body, "logprobs", False)
        top_logprobs = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0) or 0
        if top_logprobs and not logprobs:
            raise err("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        ctk = body.get("chat_template_kwargs") or {}
        if not isinstance(ctk, dict):
            raise err("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        enable_thinking = body.get("enable_thinking", ctk.get("enable_thinking"))
        if enable_thinking is not None and not isinstance(enable_thinking, bool):
            raise err("'enable_thinking' must be a boolean", "enable_thinking")
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in ("none", "minimal", "low", "medium", "high"):
            raise err("'reasoning_effort' must be none, minimal, low, medium or high", "reasoning_effort")
        if effort == "none" and enable_thinking is None:
            enable_thinking = False
        seeded = seed_and_top_k(body)
        messages = _messages(body.get("messages"))
        tool_choice = _tool_choice(body.get("tool_choice"), tools)
        parallel_tool_calls = flag(body, "parallel_tool_calls", True)
        response_format = _response_format(body.get("response_format"))
        return cls(
            messages=messages,
            model=model,
            adapter=adapter_field(body),
            stream=stream,
            include_usage=usage,
            include_progress=progress,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            response_format=response_format,
            max_tokens=max_tokens,
            **seeded,
            **sampling(body),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            chat_template_kwargs=dict(ctk),
            enable_thinking=enable_thinking,
            reasoning_effort=effort,
            n=n,
            skipped_tools=skipped,
        )

    @property
    def strict_schema(self) -> dict[str, Any] | None:
        """The schema to enforce with a grammar, when strict json_schema was asked."""
        rf = self.response_format
        if rf and rf["type"] == "json_schema" and rf["json_schema"]["strict"]:
            return rf["json_schema"]["schema"]
        return None

    @property
    def loose_schema(self) -> dict[str, Any] | None:
        """The schema a non-strict JSON mode asks for (enforced best-effort unless the
        server keeps those modes sanitize-only): ``json_object``'s is any JSON object,
        a ``json_schema`` without ``strict: true`` its own schema."""
        rf = self.response_format
        if rf and rf["type"] == "json_object":
            return {"type": "object"}
        if rf and rf["type"] == "json_schema" and not rf["json_schema"]["strict"]:
            return rf["json_schema"]["schema"]
        return None
