"""Ollama's request bodies (``/api/chat``, ``/api/generate``, ``/api/embed``,
``/api/embeddings``) validated into the engine's requests.

Sans-IO.  The field names, defaults and error texts are Ollama's
(``api/types.go``, ``server/routes.go``): ``stream`` defaults to true,
``options`` holds the sampler settings (Ollama's defaults when absent:
``temperature`` 0.8, ``top_k`` 40, ``top_p`` 0.9), ``format`` is ``"json"`` or
a JSON schema (enforced by the engine's grammar), ``think`` is a boolean or
``"high"`` / ``"medium"`` / ``"low"`` (``"max"`` is sent as ``high``).

What maps to what (the chat body built is validated by
:meth:`ChatRequest.from_openai <afm_core.api.chat_request.ChatRequest.from_openai>`):

* ``messages``: ``role`` (lower-cased, as Ollama does), ``content``,
  ``thinking`` (an assistant turn's reasoning), ``tool_calls`` (arguments as
  an object; sent to the template as JSON text), ``tool_name`` /
  ``tool_call_id`` of a ``tool`` message.  ``images`` are refused (400: the
  model reads text only).  No messages (or ``/api/generate`` without a
  ``prompt``) only loads the model, ``keep_alive: 0`` unloads it
  (``done_reason`` ``load`` / ``unload``), as Ollama does.
* ``options``: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed`` (a
  negative one: random), ``num_predict`` (-1 or -2: up to the context's end),
  ``stop``, ``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``.
  The options for the runner (``num_ctx``, ``num_batch``, ``num_gpu``,
  ``num_thread``, ``use_mmap``, ...) and the samplers afm does not have
  (``typical_p``, ``repeat_last_n``, ``mirostat*``, ``tfs_z``, ...) are
  type-checked and ignored: afm serves the model's whole context (``/api/show``
  says how long).  Unknown options are ignored, as Ollama's warning does.
* ``/api/generate``: ``prompt`` (with ``system``: a two-message chat through
  the model's template), ``raw`` (the prompt as is, no template), ``suffix``
  (fill-in-the-middle, raw); ``template`` and ``context`` (Ollama-specific
  Go templates and the deprecated token context) are refused (400).
* ``logprobs`` / ``top_logprobs`` (0-20) as Ollama's; ``truncate`` and
  ``shift`` are accepted (a prompt beyond the context is a 400).

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from .._errors import RequestError, UnsupportedError
from ._validate import as_float, json_object
from .chat_request import MAX_TOP_LOGPROBS, ChatRequest
from .completions_request import CompletionRequest

__all__ = ["DEFAULT_OPTIONS", "EmbedCall", "OllamaCall", "parse_chat", "parse_embed", "parse_embeddings",
           "parse_generate"]

DEFAULT_OPTIONS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
"""Ollama's sampler defaults (``api.DefaultOptions``), used when ``options`` leaves them out."""

THINK_LEVELS = ("high", "medium", "low", "max")

_INT, _FLOAT, _BOOL, _STRINGS = "integer", "float32", "boolean", "array"
# every option Ollama's Options / Runner structs have (and the client's typed Options), by kind
_OPTIONS = {
    **dict.fromkeys(("num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx", "num_batch",
                     "num_gpu", "main_gpu", "num_thread", "draft_num_predict", "mirostat"), _INT),
    **dict.fromkeys(("top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
                     "frequency_penalty", "tfs_z", "mirostat_tau", "mirostat_eta"), _FLOAT),
    **dict.fromkeys(("use_mmap", "numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock",
                     "embedding_only", "penalize_newline"), _BOOL),
    "stop": _STRINGS,
}
# Ollama option -> the chat body's field (the others are ignored)
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "stop": "stop"}


@dataclass(frozen=True, slots=True)
class OllamaCall:
    """A validated ``/api/chat`` or ``/api/generate`` body."""

    model: str
    request: ChatRequest | CompletionRequest | None
    """What to generate; None: nothing (the body only loads the model, or with
    ``keep_alive: 0`` unloads it)."""
    stream: bool = True
    logprobs: bool = False


@dataclass(frozen=True, slots=True)
class EmbedCall:
    """A validated ``/api/embed`` (or legacy ``/api/embeddings``) body."""

    model: str
    inputs: tuple[str, ...]
    truncate: bool = True
    """Cut an input longer than the context (Ollama's default) instead of a 400."""
    dimensions: int | None = None


def _err(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param=param)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _err("model is required", "model")
    return model


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _err(f"json: cannot unmarshal {type(v).__name__} into field {key} of type bool", key)
    return v


def _text(body: dict[str, Any], key: str) -> str:
    v = body.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise _err(f"json: cannot unmarshal {type(v).__name__} into field {key} of type string", key)
    return v


def _option(key: str, value: Any) -> Any:
    """One option's value, type-checked as Ollama's ``Options.FromMap`` does."""
    kind = _OPTIONS[key]
    if kind == _INT:
        f = as_float(value)
        if f is None or not math.isfinite(f):
            raise _err(f"option \"{key}\" must be of type integer", f"options.{key}")
        return int(f)
    if kind == _FLOAT:
        f = as_float(value)
        if f is None:
            raise _err(f"option \"{key}\" must be of type float32", f"options.{key}")
        return f
    if kind == _BOOL:
        if not isinstance(value, bool):
            raise _err(f"option \"{key}\" must be of type boolean", f"options.{key}")
        return value
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _err(f"option \"{key}\" must be of an array of strings", f"options.{key}")
    return [s for s in value if s]


def sampling(raw: Any) -> dict[str, Any]:
    """The chat body's sampler fields for an Ollama ``options`` object."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _err("json: cannot unmarshal options: must be an object", "options")
    options = {k: _option(k, v) for k, v in raw.items() if k in _OPTIONS and v is not None}
    out: dict[str, Any] = {field: options.get(key, DEFAULT_OPTIONS.get(key))
                           for key, field in _SAMPLING.items() if key in options or key in DEFAULT_OPTIONS}
    if out.get("stop") == []:
        del out["stop"]
    seed = options.get("seed")
    if seed is not None and seed >= 0:
        out["seed"] = seed
    predict = options.get("num_predict")
    if predict is not None and predict > 0:
        out["max_tokens"] = predict  # -1 (the default), -2 and 0: up to the context's end
    if out.get("repetition_penalty", 1.0) <= 0:
        out["repetition_penalty"] = 1.0  # 0 turns the penalty off, as in llama.cpp
    if "top_k" in out and out["top_k"] < 0:
        out["top_k"] = 0
    return out


def _think(body: dict[str, Any]) -> dict[str, Any]:
    """``think`` as the chat body's ``enable_thinking`` (and ``reasoning_effort``)."""
    v = body.get("think")
    if v is None:
        return {}
    if isinstance(v, bool):
        return {"enable_thinking": v}
    if isinstance(v, str) and v in THINK_LEVELS:
        return {"enable_thinking": True, "reasoning_effort": "high" if v == "max" else v}
    raise _err(f"invalid think value: {json.dumps(v)} (must be \"high\", \"medium\", \"low\", \"max\", "
               "true, or false)", "think")


def _format(body: dict[str, Any]) -> dict[str, Any]:
    """``format`` as the chat body's ``response_format``: ``"json"`` is ``json_object``, a
    schema a non-strict ``json_schema``; both enforced by the grammar, best-effort (a schema
    it cannot compile runs unconstrained, flagged downgraded; ``--no-enforce-json-modes``:
    sanitize-only)."""
    v = body.get("format")
    if v is None or v == "":
        return {}
    if v == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(v, dict):
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "format", "schema": v, "strict": False}}}
    raise _err(f"invalid format: {json.dumps(v)}; expected \"json\" or a valid JSON Schema object", "format")


def _logprobs(body: dict[str, Any]) -> int | None:
    """The alternatives listed per token when ``logprobs`` asks (0: the token's own only), else None."""
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise _err(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    if not _flag(body, "logprobs", False):
        return None  # top_logprobs applies only with logprobs, as Ollama's
    return top or 0


def _chat_logprobs(top: int | None) -> dict[str, Any]:
    return {} if top is None else {"logprobs": True, "top_logprobs": top}


def _no_images(value: Any, param: str) -> None:
    if value:
        raise UnsupportedError("images are not supported: this model reads text only", param=param)


def _arguments(value: Any, param: str) -> str:
    if value is None:
        return "{}"
    if not isinstance(value, dict):
        raise _err("tool call arguments must be an object", param)
    return json.dumps(value, ensure_ascii=False)


def _message(m: Any, i: int) -> dict[str, Any]:
    """One Ollama message as an OpenAI chat message."""
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _err("each message must be an object", p)
    role = m.get("role")
    if not isinstance(role, str):
        raise _err("a message needs a 'role'", f"{p}.role")
    _no_images(m.get("images"), f"{p}.images")
    out: dict[str, Any] = {"role": role.lower(), "content": _text(m, "content")}
    thinking = _text(m, "thinking")
    if thinking and out["role"] == "assistant":
        out["reasoning_content"] = thinking
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise _err("'tool_calls' must be an array", f"{p}.tool_calls")
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise _err("a tool call needs a 'function' object", f"{p}.tool_calls[{j}]")
            out["tool_calls"].append({
                "id": call.get("id") or f"call_{i}_{j}", "type": "function",
                "function": {"name": fn.get("name"),
                             "arguments": _arguments(fn.get("arguments"), f"{p}.tool_calls[{j}]")}})
    if out["role"] == "tool":
        for key, field in (("tool_call_id", "tool_call_id"), ("tool_name", "name")):
            if _text(m, key):
                out[field] = m[key]
    return out


def parse_chat(body: Any) -> OllamaCall:
    """Validate an ``/api/chat`` body (raises :class:`RequestError` with Ollama's texts)."""
    body = json_object(body)
    model = _model(body)
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise _err("json: cannot unmarshal messages: must be an array", "messages")
    if not messages:
        return OllamaCall(model, None, stream=_flag(body, "stream", True))
    top = _logprobs(body)
    chat = {"model": model, "messages": [_message(m, i) for i, m in enumerate(messages)],
            **sampling(body.get("options")), **_think(body), **_format(body), **_chat_logprobs(top)}
    if body.get("tools"):
        chat["tools"] = body["tools"]
    return OllamaCall(model, ChatRequest.from_openai(chat), stream=_flag(body, "stream", True),
                      logprobs=top is not None)


def parse_generate(body: Any) -> OllamaCall:
    """Validate an ``/api/generate`` body (raises :class:`RequestError` with Ollama's texts)."""
    body = json_object(body)
    model = _model(body)
    prompt, system, suffix = _text(body, "prompt"), _text(body, "system"), _text(body, "suffix")
    raw = _flag(body, "raw", False)
    _no_images(body.get("images"), "images")
    if _text(body, "template"):
        raise UnsupportedError("'template' (an Ollama Go template) is not supported: the model's own "
                               "chat template is used", param="template")
    if body.get("context"):
        raise UnsupportedError("'context' (deprecated in Ollama) is not supported: send the "
                               "conversation to /api/chat", param="context")
    if raw and system:
        raise _err("raw mode does not support template, system, or context", "raw")
    if not prompt and not suffix:
        return OllamaCall(model, None, stream=_flag(body, "stream", True))
    settings = sampling(body.get("options"))
    stream = _flag(body, "stream", True)
    top = _logprobs(body)
    if raw or suffix:
        if body.get("format") not in (None, ""):
            raise UnsupportedError("'format' is not supported with raw or suffix", param="format")
        completion = CompletionRequest.from_openai(
            {"model": model, **settings, "suffix": suffix or None, "logprobs": top}, prompt)
        if "max_tokens" not in settings:
            completion = dataclasses.replace(completion, max_tokens=None)
        return OllamaCall(model, completion, stream=stream, logprobs=top is not None)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    chat = {"model": model, "messages": messages, **settings, **_think(body), **_format(body),
            **_chat_logprobs(top)}
    return OllamaCall(model, ChatRequest.from_openai(chat), stream=stream, logprobs=top is not None)


def parse_embed(body: Any) -> EmbedCall:
    """Validate an ``/api/embed`` body: ``input`` a string or strings (an empty one: no vectors)."""
    body = json_object(body)
    model = _model(body)
    v = body.get("input")
    if isinstance(v, str):
        inputs: tuple[str, ...] = (v,) if v else ()
    elif isinstance(v, list) and all(isinstance(s, str) for s in v):
        inputs = tuple(v)
    elif v is None:
        inputs = ()
    else:
        raise _err("invalid input type", "input")
    if any(not s for s in inputs):
        raise _err("invalid input: an input must not be empty", "input")
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)):
        raise _err("json: cannot unmarshal dimensions: must be an integer", "dimensions")
    return EmbedCall(model, inputs, truncate=_flag(body, "truncate", True),
                     dimensions=dims if dims and dims > 0 else None)


def parse_embeddings(body: Any) -> EmbedCall:
    """Validate a legacy ``/api/embeddings`` body (``prompt``: one text, or none)."""
    body = json_object(body)
    prompt = _text(body, "prompt")
    return EmbedCall(_model(body), (prompt,) if prompt else ())
