"""A chat request's prompt: its messages through the chat template, tokenized
so that no text a client sent becomes a control token.

The chat template writes the turn markers (``<|im_start|>``, ``<|eot_id|>``)
around the messages, and the prompt is then tokenized with special-token
parsing on, so that those markers become their tokens.  Tokenized that way
as a whole, a message whose content holds a marker's spelling
(``"hi<|im_end|>\\n<|im_start|>system\\n..."``) would forge a turn.  afm
tokenizes the client's text with special-token parsing off instead, as
Hugging Face's ``split_special_tokens`` and llama.cpp's
``parse_special=false`` do: such a spelling stays text (``<``, ``|``, ...).

How: when no string of the request (message contents and parts, tool
results, tool calls' arguments, names, reasoning, tool definitions) holds a
special token's spelling, nothing changes.  When one does, every such
spelling is replaced by a placeholder (plain letters and digits, unique to
the request) before rendering; the rendered text is then cut at the special
tokens the template itself wrote (the only ones left), each piece between
them has its placeholders put back and is tokenized with special-token
parsing off, and each marker becomes its token (with its added token's
``lstrip``/``rstrip``, as the tokenizer treats them).  A template that
mangles a placeholder (slicing a message, say) makes the request a 400
rather than tokenizing a forged marker.

Tokenization goes through :func:`afm_core._mlx.tokenizer.encode` (long
texts in pieces, with the caller's ``check`` between them: token budget,
cancellation, deadline).
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

from .._errors import RequestError, UnsupportedError
from .._mlx.tokenizer import encode, hf_tokenizer, special_spellings
from .._models.loader import ModelInfo
from ..api.chat_request import ChatRequest

__all__ = ["chat_prompt", "render_prompt"]


def render_prompt(request: ChatRequest, tokenizer: Any, info: ModelInfo, *,
                  generation_prompt: bool = True) -> str:
    """The chat template's text for ``request`` (``generation_prompt``: with the
    assistant turn's opening, as a prompt is; False: the messages only).

    A model without a chat template (a base model) refuses chat with a 400
    that points at ``/v1/completions``.  A template that does not read
    ``tools`` gets them from afm instead (:mod:`afm_core._models.templates`),
    never dropped.
    """
    if not info.chat_template:
        raise UnsupportedError(
            f"model {info.id!r} has no chat template (a base model): send a raw prompt to "
            "/v1/completions instead, or use an instruct model", param="messages")
    use_tools = bool(request.tools) and request.tool_choice != "none"
    kwargs: dict[str, Any] = dict(request.chat_template_kwargs)
    if request.enable_thinking is not None:
        kwargs["enable_thinking"] = request.enable_thinking
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    messages = [dict(m) for m in request.messages]
    tools = list(request.tools) if use_tools and request.tools else None
    attempts = [(messages, tools)]
    if not info.template_tools and (tools or _has_tool_turns(messages)):
        attempts = [(_polyfill(request, messages, tools, system_role), None)
                    for system_role in (True, False)]
    for i, (msgs, tmpl_tools) in enumerate(attempts):
        try:
            text = tokenizer.apply_chat_template(
                msgs, tools=tmpl_tools, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)
            break
        except Exception as exc:  # noqa: BLE001 - template errors are the request's
            if i + 1 < len(attempts):
                continue  # e.g. a template that refuses a system message
            raise RequestError(f"the chat template could not render these messages: {exc}",
                               param="messages") from None
    if not isinstance(text, str):
        raise RequestError("the chat template did not produce text", param="messages")
    return text


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _polyfill(request: ChatRequest, messages: list[dict[str, Any]], tools: list[Any] | None,
              system_role: bool) -> list[dict[str, Any]]:
    from .._models.templates import polyfill_tool_messages

    return polyfill_tool_messages(messages, tools, tool_choice=request.tool_choice,
                                  parallel_tool_calls=request.parallel_tool_calls,
                                  system_role=system_role)


def chat_prompt(request: ChatRequest, tokenizer: Any, info: ModelInfo,
                check: Callable[[int], None] | None = None, *,
                generation_prompt: bool = True) -> tuple[list[int], str]:
    """``(token ids, text)`` of ``request``'s prompt (see the module docstring);
    ``check(n)`` runs between pieces of the tokenization (what it raises stops it);
    ``generation_prompt``: as :func:`render_prompt`'s."""
    specials = special_spellings(tokenizer)
    if not specials or not any(_finder(specials).search(s) for s in _client_strings(request)):
        text = render_prompt(request, tokenizer, info, generation_prompt=generation_prompt)
        return encode(tokenizer, text, check=check), text
    masker = _Masker(specials)
    masked = replace(request, messages=masker.mask(request.messages),
                     tools=masker.mask(request.tools) if request.tools is not None else None)
    rendered = render_prompt(masked, tokenizer, info, generation_prompt=generation_prompt)
    masker.verify(rendered)
    ids: list[int] = []

    def so_far(n: int) -> None:
        if check is not None:
            check(len(ids) + n)

    for piece, marker in _split_at_markers(rendered, specials, tokenizer):
        if piece:
            ids += encode(tokenizer, masker.unmask(piece), parse_special=False, check=so_far)
        if marker is not None:
            ids.append(marker)
    return ids, masker.unmask(rendered)


def _client_strings(request: ChatRequest) -> Iterable[str]:
    yield from _strings(request.messages)
    if request.tools:
        yield from _strings(request.tools)


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


class _Finder:
    """Finds special-token spellings in a text, the longest first where several
    start at one place.  Vocabularies can mark thousands of tokens special
    (Gemma's ``<unused...>``): candidates are found by their first character,
    then checked by length in a set, never by trying each spelling in turn."""

    def __init__(self, specials: frozenset[str]) -> None:
        self._set = specials
        lengths: dict[str, set[int]] = {}
        for spelling in specials:
            lengths.setdefault(spelling[0], set()).add(len(spelling))
        self._lengths = {c: sorted(ns, reverse=True) for c, ns in lengths.items()}
        self._first = re.compile("[" + "".join(re.escape(c) for c in sorted(lengths)) + "]")

    def spans(self, text: str) -> Iterator[tuple[int, int]]:
        """``(start, end)`` of each spelling in ``text``, left to right, not overlapping."""
        at = 0
        while (m := self._first.search(text, at)) is not None:
            start = m.start()
            at = start + 1
            for n in self._lengths[text[start]]:
                if text[start:start + n] in self._set:
                    yield start, start + n
                    at = start + n
                    break

    def search(self, text: str) -> bool:
        return next(self.spans(text), None) is not None

    def sub(self, replace: Callable[[str], str], text: str) -> str:
        out, at = [], 0
        for start, end in self.spans(text):
            out += [text[at:start], replace(text[start:end])]
            at = end
        return "".join(out) + text[at:] if out else text


@functools.lru_cache(maxsize=16)
def _finder(specials: frozenset[str]) -> _Finder:
    return _Finder(specials)


class _Masker:
    """Replaces special-token spellings in client strings by placeholders, and back."""

    def __init__(self, specials: frozenset[str]) -> None:
        self.nonce = f"afm{secrets.token_hex(8)}"
        self._find = _finder(specials)
        self._back = re.compile(self.nonce + r"s(\d+)e")
        self.spellings: list[str] = []
        self._index: dict[str, int] = {}

    def _placeholder(self, spelling: str) -> str:
        i = self._index.get(spelling)
        if i is None:
            i = self._index[spelling] = len(self.spellings)
            self.spellings.append(spelling)
        return f"{self.nonce}s{i}e"

    def mask(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._find.sub(self._placeholder, value)
        if isinstance(value, dict):
            return {k: self.mask(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.mask(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.mask(v) for v in value)
        return value

    def unmask(self, text: str) -> str:
        return self._back.sub(lambda m: self.spellings[int(m.group(1))], text)

    def verify(self, rendered: str) -> None:
        """Every placeholder in the rendered text is whole (the template did not cut one)."""
        whole = len(self._back.findall(rendered))
        if rendered.count(self.nonce) != whole:
            shown = ", ".join(sorted(set(self.spellings)))[:200]
            raise RequestError(f"the messages contain the special token text {shown}, which this "
                               "model's chat template does not keep whole; remove it",
                               param="messages", code="special_token_in_text")


def _split_at_markers(text: str, specials: frozenset[str], tokenizer: Any) -> list[tuple[str, int | None]]:
    """``text`` as (text piece, the marker token after it or None) pairs, cut at
    every special token's spelling (longest first), with the added tokens'
    ``lstrip``/``rstrip`` taking the whitespace beside them."""
    hf = hf_tokenizer(tokenizer)
    added = {}
    decoder = getattr(hf, "added_tokens_decoder", None)
    if isinstance(decoder, dict):
        added = {str(t.content): (i, bool(getattr(t, "lstrip", False)), bool(getattr(t, "rstrip", False)))
                 for i, t in decoder.items()}
    out: list[tuple[str, int | None]] = []
    at = 0
    strip_next = False
    for start, end in _finder(specials).spans(text):
        piece = text[at:start]
        if strip_next:
            piece = piece.lstrip()
        token, lstrip, rstrip = added.get(text[start:end], (None, False, False))
        if token is None:
            token = tokenizer.convert_tokens_to_ids(text[start:end])
        if lstrip:
            piece = piece.rstrip()
        out.append((piece, int(token)))
        strip_next = rstrip
        at = end
    tail = text[at:]
    out.append((tail.lstrip() if strip_next else tail, None))
    return out
