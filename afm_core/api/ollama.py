"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/version``) as a sans-IO translation.

::

    call = ollama.parse_chat(body)          # or parse_generate; raises RequestError
    writer = ollama.Writer(model=call.model, chat=True, stream=call.stream,
                           logprobs=call.logprobs, started=t0, loaded=t1)
    writer.feed(0, batch) ...               # NDJSON lines (the protocol of .writer)
    writer.result()                         # with stream=False: the one response object

The requests are :mod:`afm_core.api.ollama_request`'s.  The responses follow
Ollama's ``api.ChatResponse`` / ``api.GenerateResponse``:

* streamed (``application/x-ndjson``): one line per engine step while the
  answer comes, ``{"model", "created_at", "message": {"role": "assistant",
  "content", "thinking"?}, "done": false}`` (``/api/generate``: ``"response"``
  and ``"thinking"`` instead of ``message``), with ``logprobs`` (``token``,
  ``logprob``, ``bytes``, ``top_logprobs``) when asked; the tool calls, each
  complete, ``{"id", "function": {"index", "name", "arguments": {...}}}``
  (arguments as an object, as Ollama's: ``{}`` when the model wrote no JSON
  object), in one line after the answer's text; then the last line, ``"done":
  true`` with ``done_reason`` (``stop``, ``length``; a tool call or a cancel
  is ``stop``, as Ollama's runner says) and the timings in nanoseconds:
  ``total_duration`` (from the request's arrival), ``load_duration`` (waiting
  for the model to load), ``prompt_eval_count`` (the prompt's tokens, cached
  ones included), ``prompt_eval_duration`` (until the first output),
  ``eval_count`` and ``eval_duration`` (the generated tokens, and the time
  since the first one);
* not streamed: the same last object, with the whole ``message`` (or
  ``response`` and ``thinking``), the tool calls and every ``logprobs`` entry.

A failure after the stream began is a line ``{"error": "..."}`` (the
``ollama`` client raises it as ``ResponseError``); before, the HTTP layer
answers ``{"error": "..."}`` with the status (:func:`error_body`).  With an
``X-AFM-Profile`` header the last object carries ``afm_profile`` too.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard library.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import GenerationError
from .._stream.events import (
    ContentDelta,
    Event,
    Finish,
    LogprobsDelta,
    Profile,
    ReasoningDelta,
    StreamFailure,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    clamp_logprob,
)
from .._stream.sse import dumps, escape_json_string
from .ollama_request import (
    EmbedCall,
    OllamaCall,
    parse_chat,
    parse_embed,
    parse_embeddings,
    parse_generate,
)
from .writer import INTERRUPTED

__all__ = ["OLLAMA_VERSION", "EmbedCall", "ModelFacts", "OllamaCall", "Writer", "embed_response",
           "error_body", "loaded_response", "parse_chat", "parse_embed", "parse_embeddings",
           "parse_generate", "ps_response", "rfc3339", "show_response", "tags_response",
           "version_response"]

OLLAMA_VERSION = "0.32.15"
"""The Ollama release whose API this translation follows (``/api/version`` says it)."""

DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "cancelled": "stop"}


def error_body(message: str) -> dict[str, Any]:
    """Ollama's error envelope, ``{"error": "..."}`` (the status says the kind)."""
    return {"error": message}


def rfc3339(seconds: float | None = None, nanos: int | None = None) -> str:
    """A UTC time as Go writes ``time.Time`` (RFC 3339, nanoseconds, ``Z``); now by default."""
    if nanos is None:
        nanos = time.time_ns() if seconds is None else int(seconds * 1e9)
    whole, frac = divmod(nanos, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{frac:09d}Z"


def _logprob(entry: TokenLogprob) -> dict[str, Any]:
    out: dict[str, Any] = {"token": entry.token, "logprob": clamp_logprob(entry.logprob)}
    if entry.bytes is not None:
        out["bytes"] = list(entry.bytes)
    out["top_logprobs"] = [{"token": t.token, "logprob": clamp_logprob(t.logprob),
                            **({"bytes": list(t.bytes)} if t.bytes is not None else {})}
                           for t in entry.top_logprobs]
    return out


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as the object Ollama sends (``{}`` unless the model wrote one)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class Writer:
    """One ``/api/chat`` (``chat=True``) or ``/api/generate`` response: engine
    events in, NDJSON lines or the response object out (one choice).

    ``started`` and ``loaded`` are ``clock()`` readings (nanoseconds, monotonic)
    at the request's arrival and once its model was ready.  The protocol of
    :class:`afm_core.api.writer.Writer`; see the module docstring.
    """

    media_type = "application/x-ndjson"
    stop_requested = False

    def __init__(self, *, model: str, chat: bool = True, stream: bool = True, logprobs: bool = False,
                 started: int | None = None, loaded: int | None = None,
                 clock: Callable[[], int] = time.monotonic_ns, now: Callable[[], str] = rfc3339) -> None:
        self.model = model
        self.chat = chat
        self.streaming = stream
        self.logprobs = logprobs
        self._clock = clock
        self._now = now
        self.started = clock() if started is None else started
        self.loaded = self.started if loaded is None else loaded
        self._first: int | None = None  # when the first output came
        self._done_at: int | None = None
        self._head = dumps({"model": model})[:-1] + b',"created_at":"'
        if chat:
            self._text_key = b'","message":{"role":"assistant","content":'
            self._think_key = b'","message":{"role":"assistant","content":"","thinking":'
            self._tail = b'},"done":false}\n'
        else:
            self._text_key = b'","response":'
            self._think_key = b'","response":"","thinking":'
            self._tail = b',"done":false}\n'
        self._content: list[str] = []  # the whole answer (kept for the non-streamed object)
        self._thinking: list[str] = []
        self._calls: dict[int, list[Any]] = {}  # index -> [id, name, [argument pieces]]
        self._lps: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.profile: Profile | None = None
        self.failure: str | None = None
        self._ended = False

    # -- state ---------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._ended

    def ended(self, choice: int = 0) -> bool:
        return self._ended

    # -- the stream ----------------------------------------------------------------

    def start(self) -> bytes:
        return b""

    def keepalive(self) -> bytes:
        return b""  # a blank line would break the clients' line-by-line JSON parsing

    def end(self) -> bytes:
        return b""

    def _line(self, obj: dict[str, Any]) -> bytes:
        return dumps(obj) + b"\n" if self.streaming else b""

    def feed(self, choice: int, events: Sequence[Event]) -> bytes:
        if self._ended:
            return b""
        if self._first is None:
            self._first = self._clock()  # (a step's events all came at once)
        if len(events) == 1 and self.streaming:  # the common step: one delta
            event = events[0]
            kind = type(event)
            if kind is ContentDelta or kind is ReasoningDelta:
                key = self._text_key if kind is ContentDelta else self._think_key
                (self._content if kind is ContentDelta else self._thinking).append(event.text)  # type: ignore[union-attr]
                return self._head + self._now().encode() + key + escape_json_string(event.text) + self._tail  # type: ignore[union-attr]
        return self._step(events)

    def _step(self, events: Sequence[Event]) -> bytes:
        text: list[str] = []
        thinking: list[str] = []
        lps: list[dict[str, Any]] = []
        for event in events:
            match event:
                case ContentDelta(text=t):
                    text.append(t)
                case ReasoningDelta(text=t):
                    thinking.append(t)
                case ToolCallDelta(index=index, arguments=arguments, id=call_id, name=name):
                    call = self._calls.setdefault(index, [call_id, name, []])
                    call[0] = call[0] or call_id
                    call[1] = call[1] or name
                    if arguments:
                        call[2].append(arguments)
                case LogprobsDelta(content=content):
                    if self.logprobs:
                        lps += [_logprob(e) for e in content]
                case Finish(reason=reason):
                    self.finish = reason
                    self._done_at = self._clock()
                case Usage():
                    self.usage = event
                case Profile():
                    self.profile = event
                case StreamFailure(message=message):
                    return self._failed(message)
        self._content += text
        self._thinking += thinking
        self._lps += lps
        out = b""
        if text or thinking or lps:
            out = self._line(self._chunk("".join(text), "".join(thinking), lps))
        if self.finish is not None and self.usage is not None:
            out += self._last()
        return out

    def _chunk(self, text: str, thinking: str, lps: list[dict[str, Any]], *,
               calls: list[dict[str, Any]] | None = None, done: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": self._now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = done
        if lps:
            out["logprobs"] = lps
        return out

    def _tool_calls(self) -> list[dict[str, Any]]:
        return [{"id": call[0] or f"call_{i}", "function": {"index": n, "name": call[1] or "",
                                                            "arguments": _arguments("".join(call[2]))}}
                for n, (i, call) in enumerate(sorted(self._calls.items()))]

    def _last(self) -> bytes:
        """The tool calls (when there are some), then the ``done`` object."""
        self._ended = True
        out = b""
        if self._calls and self.streaming:
            out = self._line(self._chunk("", "", [], calls=self._tool_calls()))
        return out + self._line(self._final())

    def _final(self) -> dict[str, Any]:
        streamed = self.streaming
        out = self._chunk("" if streamed else "".join(self._content),
                          "" if streamed else "".join(self._thinking), [] if streamed else self._lps,
                          calls=None if streamed else self._tool_calls(), done=True)
        out["done_reason"] = DONE_REASONS.get(self.finish or "stop", "stop")
        done_at = self._done_at if self._done_at is not None else self._clock()
        first = self._first if self._first is not None else done_at
        usage = self.usage or Usage(0, 0)
        out.update(total_duration=done_at - self.started, load_duration=self.loaded - self.started,
                   prompt_eval_count=usage.prompt_tokens,
                   prompt_eval_duration=max(first - self.loaded, 0),
                   eval_count=usage.completion_tokens, eval_duration=done_at - first)
        if self.profile is not None:
            out[self.profile.key] = self.profile.payload
        return out

    def _failed(self, message: str) -> bytes:
        self._ended = True
        self.failure = message or "generation failed"
        return self._line(error_body(self.failure))

    def close(self, choice: int = 0) -> bytes:
        if self._ended:
            return b""
        if self.finish is not None:
            return self._last()
        return self._failed(INTERRUPTED.message)

    def fail(self, message: str) -> bytes:
        return b"" if self._ended else self._failed(message)

    def result(self) -> dict[str, Any]:
        if self.streaming:
            raise ValueError("a streaming writer builds no result: make it with stream=False")
        if self.failure is not None:
            raise GenerationError(self.failure)
        return self._final()


def loaded_response(model: str, *, chat: bool, reason: str) -> dict[str, Any]:
    """The answer to a body with nothing to generate: ``done_reason`` ``load`` or ``unload``."""
    out: dict[str, Any] = {"model": model, "created_at": rfc3339()}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    out.update(done=True, done_reason=reason)
    return out


def embed_response(model: str, vectors: Sequence[Sequence[float]], *, prompt_tokens: int,
                   total_ns: int, load_ns: int) -> dict[str, Any]:
    """``/api/embed``'s answer."""
    return {"model": model, "embeddings": [list(v) for v in vectors], "total_duration": total_ns,
            "load_duration": load_ns, "prompt_eval_count": prompt_tokens}


# -- the models ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the model endpoints say about one served model (the HTTP layer gathers it)."""

    name: str
    size: int = 0
    modified_at: float = 0.0
    """Seconds since the epoch (its files' last change)."""
    digest: str = ""
    format: str = ""
    """``gguf`` or ``safetensors`` (an mlx-lm directory)."""
    family: str = ""
    """The architecture (``model_type``: ``llama``, ``qwen2``, ...)."""
    parameter_size: str = ""
    quantization_level: str = ""
    context_length: int | None = None
    embedding_length: int | None = None
    template: str = ""
    """The chat template (Jinja, not Ollama's Go template), once known."""
    capabilities: tuple[str, ...] = ("completion",)


def _details(m: ModelFacts) -> dict[str, Any]:
    return {"parent_model": "", "format": m.format, "family": m.family,
            "families": [m.family] if m.family else None, "parameter_size": m.parameter_size,
            "quantization_level": m.quantization_level}


def tags_response(models: Sequence[ModelFacts]) -> dict[str, Any]:
    """``/api/tags``: every served model."""
    return {"models": [{"name": m.name, "model": m.name, "modified_at": rfc3339(m.modified_at),
                        "size": m.size, "digest": m.digest, "details": _details(m)} for m in models]}


def show_response(m: ModelFacts) -> dict[str, Any]:
    """``/api/show``: one model's details, ``model_info`` keyed as GGUF metadata is."""
    arch = m.family or "unknown"
    info: dict[str, Any] = {"general.architecture": arch, "general.name": m.name}
    if m.context_length:
        info[f"{arch}.context_length"] = m.context_length
    if m.embedding_length:
        info[f"{arch}.embedding_length"] = m.embedding_length
    return {"license": "", "modelfile": f"# served by afm\nFROM {m.name}\n", "parameters": "",
            "template": m.template, "details": _details(m), "model_info": info,
            "capabilities": list(m.capabilities), "modified_at": rfc3339(m.modified_at)}


def ps_response(models: Sequence[tuple[ModelFacts, float, int]]) -> dict[str, Any]:
    """``/api/ps``: the loaded models, each with when it will be unloaded (seconds since
    the epoch) and its bytes in GPU memory."""
    return {"models": [{"name": m.name, "model": m.name, "size": m.size, "digest": m.digest,
                        "details": _details(m), "expires_at": rfc3339(expires), "size_vram": vram,
                        "context_length": m.context_length or 0}
                       for m, expires, vram in models]}


def version_response(afm_version: str) -> dict[str, Any]:
    """``/api/version``: the Ollama version whose API is served (and afm's own)."""
    return {"version": OLLAMA_VERSION, "afm_version": afm_version}
