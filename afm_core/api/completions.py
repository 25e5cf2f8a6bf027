"""The legacy Completions API (``POST /v1/completions``), as a sans-IO translation.

A completions body carries one or several raw prompts (OpenAI's four
``prompt`` forms) and ``n`` choices per prompt; :func:`parse` validates it
into one :class:`~afm_core.CompletionRequest` per choice (choice ``i * n + j``
is prompt ``i``'s ``j``-th, as OpenAI numbers them), and the engine runs each
as its own stream.  :class:`CompletionWriter` turns the streams' events into
``text_completion`` chunks::

    call = completions.parse(body)                      # raises RequestError
    writer = completions.CompletionWriter(call, id=..., created=..., model=...,
                                          echo=prompt_texts)
    chunks = writer.feed(index, events, stream.prompt_logprobs)
    sse = completions.encode(chunks)                    # ... then completions.DONE

and :func:`collect` folds the same chunks into the non-streaming object, so
both forms say the same thing.  :class:`Writer` is the same over the one
writer protocol (:mod:`afm_core.api.writer`): ``data:`` frames and
``data: [DONE]``, or the folded object.  The chunks:

* with ``stream_options.include_progress``, while the prompt is prefilled,
  prompt-progress chunks (``choices`` empty, ``prompt_progress``: ``total``,
  ``cache``, ``processed``, ``time_ms``, as llama.cpp's) for the first choice;
* a choice's text chunks ``{"index", "text", "logprobs", "finish_reason":
  null}``; with ``echo`` the first one is the prompt's text (and, with
  ``logprobs``, the prompt's scored tokens);
* a finish chunk per choice: ``text`` empty, ``finish_reason`` ``stop``,
  ``length`` or ``cancelled``;
* once every choice finished, a usage chunk (``choices`` empty, ``usage``)
  when asked (``stream_options.include_usage``; always for :func:`collect`);
* then, when the stream was opened with a profile (the ``X-AFM-Profile``
  header: choice 0's), the engine's one profile as chat's is,
  ``{"afm_profile": {...}}`` or ``{"afm_profile_extended": {...}}`` (no
  ``choices``); :func:`collect` keeps it as a top-level field;
* a failure ends the response with an error chunk (``choices`` empty,
  ``error``): nothing of any choice follows it.

Legacy ``logprobs`` are ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`` with one entry per token: each token's text decoded alone,
its log-probability (``null`` for a prompt's first token, which has no
context), a ``{token: logprob}`` dict of the ``logprobs`` most likely tokens
(``null`` for that first token), and where its text starts: the running sum of
the token texts' lengths, from 0 for the echoed prompt and from the echo's
length (0 without echo) for the generated tokens.  Log-probabilities are
clamped to ``[-9999, 0]`` (strict JSON has no infinities).

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard
library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import AFMError, GenerationError, RequestError, StreamErrorChunk, UnsupportedError
from .._stream.events import (
    ContentDelta,
    Event,
    Finish,
    LogprobsDelta,
    Profile,
    PromptProgress,
    StreamFailure,
    TokenLogprob,
    TopLogprob,
    Usage,
    clamp_logprob,
)
from .._stream.sse import DONE, frame
from ._validate import count, flag, include_progress, include_usage, json_object
from .chat_request import MAX_N
from .completions_request import CompletionRequest, completion_prompts
from .writer import INTERRUPTED, SSE_KEEPALIVE

__all__ = [
    "DONE",
    "MAX_CHOICES",
    "Completion",
    "CompletionWriter",
    "ScoredPrompt",
    "Writer",
    "collect",
    "encode",
    "parse",
]

MAX_CHOICES = 1024
"""Choices (prompts times ``n``) one body may ask for; a server may allow fewer."""
OBJECT = "text_completion"
PROFILE_KEYS = ("afm_profile", "afm_profile_extended")


@dataclass(frozen=True, slots=True)
class Completion:
    """A validated completions body: what to run and how to answer."""

    requests: tuple[CompletionRequest, ...]
    """One engine request per choice, in choice order."""
    prompt_of: tuple[int, ...]
    """The prompt each choice continues (its usage counts each prompt once)."""
    echo: bool = False
    logprobs: int | None = None
    """Alternatives listed per token, or None for no logprobs."""
    stream: bool = False
    include_usage: bool = False
    include_progress: bool = False
    """``stream_options.include_progress``: prompt-progress chunks (``choices: []``
    and llama.cpp's ``prompt_progress`` object) for the first choice's prompt."""
    model: str | None = None

    @property
    def choices(self) -> int:
        return len(self.requests)


def _choices(body: dict[str, Any], key: str, default: int) -> int:
    """``n`` or ``best_of``: an integer in ``[1, MAX_N]`` (chat's limit too)."""
    return count(body, key, 1, MAX_N, default) or default  # never 0: at least 1


def parse(body: Any) -> Completion:
    """Validate an OpenAI completions body (raises :class:`RequestError`).

    Besides OpenAI's fields (``suffix`` and ``best_of`` equal to ``n`` only),
    vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos`` and
    ``add_special_tokens`` are honoured; other unknown fields are ignored.
    With ``n > 1`` and a ``seed``, choice ``j`` of a prompt samples with
    ``seed + j``, so the choices differ and each is reproducible.
    """
    body = json_object(body)
    prompts = completion_prompts(body.get("prompt"))
    n = _choices(body, "n", 1)
    best_of = body.get("best_of")
    if best_of is not None and _choices(body, "best_of", n) != n:
        raise UnsupportedError("'best_of' other than 'n' is not supported", param="best_of")
    if len(prompts) * n > MAX_CHOICES:
        raise RequestError(f"at most {MAX_CHOICES} choices (prompts times n) per request",
                           param="prompt")
    stream = flag(body, "stream", False)
    usage = include_usage(body)
    progress = include_progress(body)
    base = CompletionRequest.from_openai(body, prompts[0])
    requests = []
    prompt_of = []
    for i, prompt in enumerate(prompts):
        one = base if i == 0 else dataclasses.replace(base, prompt=prompt)
        for j in range(n):
            seeded = one.seed is not None and j > 0
            requests.append(dataclasses.replace(one, seed=(one.seed or 0) + j) if seeded else one)
            prompt_of.append(i)
    return Completion(
        requests=tuple(requests),
        prompt_of=tuple(prompt_of),
        echo=flag(body, "echo", False),
        logprobs=base.top_logprobs if base.logprobs else None,
        stream=stream,
        include_usage=usage,
        include_progress=progress,
        model=base.model,
    )


class ScoredPrompt(Protocol):
    """A prompt's tokens scored by the model (``afm_core.PromptLogprobs``)."""

    @property
    def tokens(self) -> Sequence[str]: ...
    @property
    def logprobs(self) -> Sequence[float | None]: ...
    @property
    def top_logprobs(self) -> Sequence[Sequence[TopLogprob]]: ...


class _Choice:
    __slots__ = ("echoed", "failed", "finish", "index", "offset", "usage")

    def __init__(self, index: int) -> None:
        self.index = index
        self.echoed = False
        self.offset = 0  # where the next token's text starts (text_offset)
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.failed = False


class CompletionWriter:
    """Turn each choice's engine events into ``text_completion`` chunks.

    ``echo`` holds each choice's prompt text when the body asked for
    ``echo`` (a token-id prompt decoded by the caller).  :meth:`feed` takes a
    choice's events as they come (one engine step or more) and, with the
    first of them, the prompt's scores when the body asked for ``echo`` and
    ``logprobs`` (``ChatStream.prompt_logprobs``).  ``usage`` (default: when
    the body asked for it, or does not stream) adds the usage chunk once every
    choice ended.
    """

    def __init__(self, call: Completion, *, id: str, created: int, model: str,
                 echo: Sequence[str] = (), usage: bool | None = None) -> None:
        if call.echo and len(echo) != call.choices:
            raise ValueError("echo needs one prompt text per choice")
        self.call = call
        self.id = id
        self.created = created
        self.model = model
        self._echo = tuple(echo)
        self._usage = (call.include_usage or not call.stream) if usage is None else usage
        self._choices = [_Choice(i) for i in range(call.choices)]
        self._open = call.choices
        self._head: dict[str, Any] = {"id": id, "object": OBJECT, "created": created, "model": model}
        self._profiles: list[Profile] = []  # held for the end (after the usage)
        self.error: dict[str, Any] | None = None
        """The first failure's error object, once a choice failed."""

    @property
    def finished(self) -> bool:
        """Every choice has ended (finished or failed)."""
        return self._open == 0

    def ended(self, index: int) -> bool:
        """Choice ``index`` has ended: its usage arrived, or it failed."""
        state = self._choices[index]
        return state.failed or state.usage is not None

    def fail(self, failure: StreamFailure) -> list[dict[str, Any]]:
        """The error chunk ending the whole response (a failure outside any one choice)."""
        if self.error is None:
            self.error = failure.to_dict()
        return [self._error_chunk(failure)]

    def _error_chunk(self, failure: StreamFailure) -> dict[str, Any]:
        chunk = dict(self._head)
        chunk["choices"] = []
        chunk["error"] = failure.to_dict()
        return chunk

    # -- chunks ------------------------------------------------------------------

    def _chunk(self, index: int, text: str, logprobs: dict[str, Any] | None,
               finish: str | None = None) -> dict[str, Any]:
        chunk = dict(self._head)
        chunk["choices"] = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
        return chunk

    def _legacy(self, state: _Choice, entries: Iterable[TokenLogprob]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            tokens.append(e.token)
            values.append(clamp_logprob(e.logprob))
            tops.append({t.token: clamp_logprob(t.logprob) for t in e.top_logprobs})
            offsets.append(state.offset)
            state.offset += len(e.token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _empty_logprobs(self) -> dict[str, Any] | None:
        if self.call.logprobs is None:
            return None
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _echo_chunk(self, state: _Choice, scored: ScoredPrompt | None) -> dict[str, Any]:
        text = self._echo[state.index]
        logprobs: dict[str, Any] | None = None
        if self.call.logprobs is not None:
            if scored is None:  # ended before it was scored (cancelled while waiting)
                logprobs = self._empty_logprobs()
            else:
                values: list[float | None] = []
                tops: list[dict[str, float] | None] = []
                offsets: list[int] = []
                for token, lp, top in zip(scored.tokens, scored.logprobs, scored.top_logprobs,
                                          strict=True):
                    values.append(None if lp is None else clamp_logprob(lp))
                    tops.append(None if lp is None else {t.token: clamp_logprob(t.logprob) for t in top})
                    offsets.append(state.offset)
                    state.offset += len(token)
                logprobs = {"tokens": list(scored.tokens), "token_logprobs": values,
                            "top_logprobs": tops, "text_offset": offsets}
        state.offset = len(text)  # the generated tokens start after the echoed text
        return self._chunk(state.index, text, logprobs)

    def feed(self, index: int, events: Sequence[Event],
             prompt_logprobs: ScoredPrompt | None = None) -> list[dict[str, Any]]:
        """The chunks for choice ``index``'s next events (none once it ended, or
        once any choice failed: the response ends with that error chunk)."""
        state = self._choices[index]
        out: list[dict[str, Any]] = []
        if self.ended(index) or self.error is not None:
            return out  # nothing follows a choice's end, nor the response's failure
        if len(events) == 1 and type(events[0]) is ContentDelta and (state.echoed or not self.call.echo):
            return [self._chunk(index, events[0].text, self._empty_logprobs())]  # the common step
        items = list(events)
        while items and type(items[0]) is PromptProgress:  # the prompt is still being prefilled
            chunk = dict(self._head)
            chunk["choices"] = []
            chunk["prompt_progress"] = items.pop(0).to_dict()  # type: ignore[union-attr]
            out.append(chunk)
        if not items and prompt_logprobs is None:
            return out  # the echo waits for the prompt's scores, which come with its first token
        if self.call.echo and not state.echoed:
            state.echoed = True
            out.append(self._echo_chunk(state, prompt_logprobs))
        i, n = 0, len(items)
        while i < n:
            event = items[i]
            i += 1
            if isinstance(event, ContentDelta):
                nxt = items[i] if i < n else None
                if isinstance(nxt, LogprobsDelta):  # the same token's: one chunk
                    out.append(self._chunk(index, event.text, self._legacy(state, nxt.content)))
                    i += 1
                else:
                    out.append(self._chunk(index, event.text, self._empty_logprobs()))
            elif isinstance(event, LogprobsDelta):  # a token whose text is still held back
                out.append(self._chunk(index, "", self._legacy(state, event.content)))
            elif isinstance(event, Finish):
                state.finish = event.reason
                out.append(self._chunk(index, "", None, event.reason))
            elif isinstance(event, Usage):
                state.usage = event
                # the profile rides after the usage, in the same batch: kept for the end
                self._profiles += [e for e in items[i:] if isinstance(e, Profile)]
                self._close(state, out)
                break
            elif isinstance(event, StreamFailure):
                state.failed = True
                if self.error is None:
                    self.error = event.to_dict()
                out.append(self._error_chunk(event))
                self._close(state, out)
                break
            elif isinstance(event, Profile):  # before its usage (not the engine's order)
                self._profiles.append(event)
            # reasoning and tool-call events do not occur for raw prompts
        return out

    def _close(self, state: _Choice, out: list[dict[str, Any]]) -> None:
        self._open -= 1
        if self._open == 0 and self.error is None:
            if self._usage:
                out.append(self.usage_chunk())
            out += [{p.key: p.payload} for p in self._profiles]  # after the usage, as chat's

    def usage_chunk(self) -> dict[str, Any]:
        """The usage of every choice so far: each prompt counted once."""
        prompt = completion = cached = 0
        counted: set[int] = set()
        for state in self._choices:
            u = state.usage
            if u is None:
                continue
            completion += u.completion_tokens
            p = self.call.prompt_of[state.index]
            if p not in counted:
                counted.add(p)
                prompt += u.prompt_tokens
                cached += u.cached_tokens
        chunk = dict(self._head)
        chunk["choices"] = []
        chunk["usage"] = Usage(prompt, completion, cached).to_dict()
        return chunk


def encode(chunks: Iterable[dict[str, Any]]) -> bytes:
    """``data: {...}`` SSE frames for ``chunks`` (then send :data:`DONE`)."""
    if isinstance(chunks, list) and len(chunks) == 1:  # the common step: one chunk
        return frame(chunks[0])
    return b"".join(frame(c) for c in chunks)


def collect(chunks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The non-streaming ``text_completion`` that ``chunks`` (every chunk of a
    response, usage included) add up to; an error chunk raises
    :class:`StreamErrorChunk` with its error object."""
    head: dict[str, Any] | None = None
    choices: dict[int, dict[str, Any]] = {}
    texts: dict[int, list[str]] = {}  # joined at the end (+= would copy the text per chunk)
    usage = None
    profiles: dict[str, Any] = {}
    for chunk in chunks:
        if "error" in chunk:
            raise StreamErrorChunk(chunk["error"])
        if "choices" not in chunk:  # a profile object (no choices): a top-level field
            profiles.update((k, v) for k, v in chunk.items() if k in PROFILE_KEYS)
            continue
        if head is None:
            head = {k: chunk[k] for k in ("id", "object", "created", "model")}
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for c in chunk["choices"]:
            got = choices.setdefault(c["index"], {"index": c["index"], "text": "", "logprobs": None,
                                                  "finish_reason": None})
            texts.setdefault(c["index"], []).append(c["text"])
            lp = c["logprobs"]
            if lp is not None:
                if got["logprobs"] is None:
                    got["logprobs"] = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                       "text_offset")}
                for k, v in lp.items():
                    got["logprobs"][k].extend(v)
            if c["finish_reason"] is not None:
                got["finish_reason"] = c["finish_reason"]
    if head is None:
        raise ValueError("no chunks to collect")
    for i, got in choices.items():
        got["text"] = "".join(texts[i])
    result = dict(head)
    result["choices"] = [choices[i] for i in sorted(choices)]
    result["usage"] = usage
    result.update(profiles)
    return result


def _as_error(exc: StreamErrorChunk) -> AFMError:
    """A failed choice of a non-streamed response, as the error to answer with."""
    if exc.type == "invalid_request_error":
        return RequestError(exc.message, param=exc.param, code=exc.code)
    return GenerationError(exc.message, code=exc.code)


class Writer:
    """One completions response, every choice: the writer protocol
    (:class:`afm_core.api.writer.Writer`) over a :class:`CompletionWriter`.

    ``prompt_logprobs(i)`` gives choice ``i``'s prompt scores once they are
    known (``ChatStream.prompt_logprobs`` of its stream; echo with logprobs).
    Streamed (``call.stream``): ``data:`` frames, then ``data: [DONE]``;
    otherwise the chunks are kept and :meth:`result` folds them (:func:`collect`).
    """

    media_type = "text/event-stream"
    stop_requested = False

    def __init__(self, call: Completion, *, id: str, created: int, model: str,
                 echo: Sequence[str] = (),
                 prompt_logprobs: Callable[[int], ScoredPrompt | None] | None = None) -> None:
        self.state = CompletionWriter(call, id=id, created=created, model=model, echo=echo)
        self.streaming = call.stream
        self._scores = prompt_logprobs
        self._kept: list[dict[str, Any]] = []

    @property
    def done(self) -> bool:
        return self.state.finished or self.state.error is not None

    def ended(self, choice: int) -> bool:
        return self.state.ended(choice) or self.state.error is not None

    def _out(self, chunks: list[dict[str, Any]]) -> bytes:
        if self.streaming:
            return encode(chunks)
        self._kept += chunks
        return b""

    def start(self) -> bytes:
        return b""

    def feed(self, choice: int, events: Sequence[Event]) -> bytes:
        # the prompt's scores matter only to an echo with logprobs
        scores = self._scores(choice) if self._scores is not None and self.state.call.echo else None
        chunks = self.state.feed(choice, events, scores)
        if self.streaming:
            return encode(chunks)
        self._kept += chunks
        return b""

    def close(self, choice: int) -> bytes:
        return b"" if self.state.ended(choice) else self._out(self.state.feed(choice, [INTERRUPTED]))

    def keepalive(self) -> bytes:
        return SSE_KEEPALIVE if self.streaming else b""

    def fail(self, message: str) -> bytes:
        if self.done:
            return b""
        return self._out(self.state.fail(StreamFailure(message, code="internal_error")))

    def end(self) -> bytes:
        return DONE if self.streaming else b""

    def result(self) -> dict[str, Any]:
        try:
            return collect(self._kept)
        except StreamErrorChunk as exc:
            raise _as_error(exc) from None
