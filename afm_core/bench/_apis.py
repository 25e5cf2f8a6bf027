"""The wire APIs ``afm bench`` can drive: request bodies and stream events.

``chat`` (``/v1/chat/completions``), ``completions`` (``/v1/completions``,
the job's prompt text raw, no chat template), ``messages`` (Anthropic
``/v1/messages``) and ``responses`` (OpenAI ``/v1/responses``).  Each API's
streamed events are read into the same :class:`Reading` (a token-bearing
delta, usage, the end of the stream, an error), so the observer's timings
mean the same on every API.  Pure functions, no I/O.

Several APIs in one run (``afm bench --api chat,messages,...``) name their
targets by *slot*: the API, with ``#2``, ``#3`` ... on a repeat (``chat,chat``
gives the slots ``chat`` and ``chat#2``, an A/A control), so one server
serves the targets ``ours[chat]``, ``ours[chat#2]`` and so on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ._workload import Job

__all__ = ["APIS", "PATHS", "Reading", "body", "prompt_form", "prompt_text", "read_event",
           "slot_api", "slot_names", "slot_target", "split_target"]

PATHS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
APIS: tuple[str, ...] = tuple(PATHS)


def slot_names(apis: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """One name per entry of ``apis``: the API, then ``API#2``, ``API#3``... on repeats."""
    seen: dict[str, int] = {}
    out: list[str] = []
    for api in apis:
        if api not in PATHS:
            raise ValueError(f"unknown API {api!r}; expected one of {', '.join(APIS)}")
        seen[api] = seen.get(api, 0) + 1
        out.append(api if seen[api] == 1 else f"{api}#{seen[api]}")
    return tuple(out)


def slot_api(slot: str) -> str:
    """The API a slot drives (``chat#2`` -> ``chat``)."""
    return slot.partition("#")[0]


def prompt_form(api: str) -> str:
    """How the raw path tokenizes a job for ``api``: ``completions`` (the
    prompt text as it is) or ``chat`` (the chat template; messages and
    responses too)."""
    return "completions" if api == "completions" else "chat"


def slot_target(kind: str, slot: str) -> str:
    """The target name of ``kind`` (``raw``, ``ours``...) driven through ``slot``."""
    return f"{kind}[{slot}]"


def split_target(name: str) -> tuple[str, str | None]:
    """``ours[chat#2]`` -> ``("ours", "chat#2")``; a plain name -> ``(name, None)``."""
    if name.endswith("]") and "[" in name:
        kind, _, slot = name[:-1].partition("[")
        return kind, slot
    return name, None


def prompt_text(job: Job) -> str:
    """The raw prompt of a ``completions`` request: the job's ``prompt``
    (the chat template rendered, in a run over several APIs), else the
    messages' text."""
    if job.prompt is not None:
        return job.prompt
    return "\n\n".join(m["content"] for m in job.messages)


def body(job: Job, api: str, *, model: str | None, stream: bool = True) -> dict[str, Any]:
    """``job`` as a request body of ``api`` (greedy, ``max_tokens`` budget, usage on)."""
    if api == "chat":
        return job.body(model=model, stream=stream)
    out: dict[str, Any]
    if api == "completions":
        out = {"prompt": prompt_text(job), "max_tokens": job.max_tokens, "temperature": 0.0,
               "stream": stream}
        if job.prompt is not None:  # the template's text holds its special tokens already
            out["add_special_tokens"] = False
        if stream:
            out["stream_options"] = {"include_usage": True}
    elif api == "messages":
        system = [m["content"] for m in job.messages if m["role"] == "system"]
        out = {"messages": [dict(m) for m in job.messages if m["role"] != "system"],
               "max_tokens": job.max_tokens, "temperature": 0.0, "stream": stream,
               "model": model or "afm"}
        if system:
            out["system"] = "\n\n".join(system)
    elif api == "responses":
        out = {"input": [dict(m) for m in job.messages], "max_output_tokens": job.max_tokens,
               "temperature": 0.0, "stream": stream, "store": False}
    else:
        raise ValueError(f"unknown API {api!r}; expected one of {', '.join(APIS)}")
    if model is not None and api != "messages":
        out["model"] = model
    return out


@dataclass(slots=True)
class Reading:
    """What one streamed event says, in the observer's terms."""

    token: bool = False  # carries generated text, reasoning or tool arguments
    done: bool = False  # the stream's last event ([DONE], message_stop, response.completed)
    output_tokens: int | None = None  # usage, when the event carries it
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None  # the error's text, when the event is one
    text: str = ""  # the generated text it carries (chat and completions)
    timings: dict[str, Any] | None = None  # llama.cpp's per-request timings, when sent


def read_event(api: str, obj: dict[str, Any]) -> Reading:
    """Read one decoded SSE data object of ``api`` (not ``[DONE]``)."""
    if api in ("chat", "completions"):
        return _read_openai(obj, api)
    if api == "messages":
        return _read_anthropic(obj)
    if api == "responses":
        return _read_responses(obj)
    raise ValueError(f"unknown API {api!r}")


def _read_openai(obj: dict[str, Any], api: str) -> Reading:
    r = Reading()
    if "error" in obj:
        r.error = json.dumps(obj["error"])[:200]
        return r
    if isinstance(obj.get("timings"), dict):
        r.timings = obj["timings"]
    usage = obj.get("usage")
    if isinstance(usage, dict):
        r.output_tokens = int(usage.get("completion_tokens") or 0)
        pt = usage.get("prompt_tokens")
        r.prompt_tokens = int(pt) if pt is not None else None
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason"):
            r.finish_reason = choice["finish_reason"]
            if r.finish_reason == "error":
                r.error = "error-marked chunk"
        if api == "completions":
            r.token = r.token or bool(choice.get("text"))
            r.text += choice.get("text") or ""
        else:
            d = choice.get("delta") or {}
            r.text += d.get("content") or ""
            r.token = r.token or bool(d.get("content") or d.get("reasoning_content")
                                      or d.get("reasoning") or d.get("tool_calls"))
    return r


def _read_anthropic(obj: dict[str, Any]) -> Reading:
    r = Reading()
    kind = obj.get("type")
    if kind == "content_block_delta":
        d = obj.get("delta") or {}
        r.token = bool(d.get("text") or d.get("thinking") or d.get("partial_json"))
    elif kind == "message_start":
        usage = (obj.get("message") or {}).get("usage") or {}
        if usage.get("input_tokens") is not None:
            r.prompt_tokens = int(usage["input_tokens"])
    elif kind == "message_delta":
        usage = obj.get("usage") or {}
        if usage.get("output_tokens") is not None:
            r.output_tokens = int(usage["output_tokens"])
        r.finish_reason = (obj.get("delta") or {}).get("stop_reason")
    elif kind == "message_stop":
        r.done = True
    elif kind == "error":
        r.error = json.dumps(obj.get("error"))[:200]
    return r


_RESPONSE_TOKEN_EVENTS = frozenset({
    "response.output_text.delta", "response.function_call_arguments.delta",
    "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
})


def _read_responses(obj: dict[str, Any]) -> Reading:
    r = Reading()
    kind = obj.get("type")
    if kind in _RESPONSE_TOKEN_EVENTS:
        r.token = bool(obj.get("delta"))
    elif kind in ("response.completed", "response.incomplete"):
        resp = obj.get("response") or {}
        usage = resp.get("usage") or {}
        if usage.get("output_tokens") is not None:
            r.output_tokens = int(usage["output_tokens"])
        if usage.get("input_tokens") is not None:
            r.prompt_tokens = int(usage["input_tokens"])
        r.done = True
        r.finish_reason = "stop" if kind == "response.completed" else str(
            (resp.get("incomplete_details") or {}).get("reason") or "incomplete")
    elif kind in ("response.failed", "error"):
        resp = obj.get("response") or {}
        r.error = str(resp.get("error") or obj.get("message") or obj)[:200]
        r.done = kind == "response.failed"
    return r
