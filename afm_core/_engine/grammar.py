"""Grammar-constrained output with llguidance token masks.

One assistant turn is described as an :class:`OutputShape` (an optional
reasoning block, then free text, a JSON document, tool calls, or text
followed by calls) and rendered as an llguidance Lark grammar by
:func:`output_grammar`.  :func:`grammar_processor` compiles it and returns an
mlx-lm logits processor that, before each sampling step, advances an
``LLMatcher`` by the tokens generated so far and masks every token the
grammar forbids.  mlx-lm applies processors row by row inside the batched
step, so constrained and free streams share one batch.  A grammar llguidance
cannot compile runs best-effort: ``(None, True)`` ("downgraded").

What gets enforced (see ``_prepare.build_job``):

* ``response_format`` ``json_schema`` with ``strict: true``: the content is
  one JSON document of that schema;
* ``tool_choice`` ``required`` or a named function (Hermes format): the turn
  is one or more ``<tool_call>`` blocks whose JSON matches the tools;
* ``tool_choice`` ``auto`` with at least one ``strict`` tool (Hermes
  format): free text (or the strict JSON document), optionally followed by
  calls; a call to a strict tool must match its ``parameters`` schema, a
  call to any other tool must be a JSON object.

A model that reasons (``<think>``) keeps its reasoning block in front of any
of these: the grammar leaves it free.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from .._mlx.tokenizer import hf_tokenizer

log = logging.getLogger("afm.grammar")
T = TypeVar("T")

_LOCK = threading.Lock()
# per Hugging Face tokenizer, weakly: an id could be reused by a later engine's tokenizer
_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_ADDED: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()

ThinkMode = Literal["off", "optional", "started"]
"""``off``: no reasoning block; ``optional``: the model may open one first;
``started``: the prompt opened it, output begins inside it."""

# the model's own JSON layout, and no runs of free whitespace to wander into
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class OutputShape:
    """What one assistant turn may look like.

    ``content`` is ``"text"`` (free text), a JSON schema (one JSON document),
    or ``None`` (no content: the turn is tool calls only).  ``calls`` are the
    JSON schemas of the allowed ``{"name": ..., "arguments": ...}`` objects
    (empty: no tool calls); ``call_tags`` must be tokens of the vocabulary.
    ``think_tags`` are tokens when ``think_tokens``, else plain text.
    """

    content: str | dict[str, Any] | None = "text"
    calls: tuple[dict[str, Any], ...] = ()
    parallel: bool = True
    think: ThinkMode = "off"
    think_tags: tuple[str, str] = ("<think>", "</think>")
    think_tokens: bool = True
    call_tags: tuple[str, str] = ("<tool_call>", "</tool_call>")

    def __post_init__(self) -> None:
        if self.content is None and not self.calls:
            raise ValueError("an output shape needs content, calls or both")
        if isinstance(self.content, str) and self.content != "text":
            raise ValueError("content must be 'text', a JSON schema or None")


def output_grammar(shape: OutputShape) -> str:
    """The llguidance Lark grammar of ``shape``.

    Free text is ``TEXT``; a token tag can never occur inside it (llguidance
    matches text by bytes, tokens by id), which is what ends it.  A reasoning
    block whose end tag is plain text ends lazily at that tag instead.
    """
    rules: list[str] = []
    if isinstance(shape.content, dict):
        schema = {**shape.content, "x-guidance": {"whitespace_flexible": False}}
        rules.append(f"content: %json {json.dumps(schema)}")
    if shape.calls:
        open_, close = shape.call_tags
        call_schema: dict[str, Any] = (dict(shape.calls[0]) if len(shape.calls) == 1
                                       else {"anyOf": list(shape.calls)})
        call_schema["x-guidance"] = _LAYOUT
        rules.append('calls: call ("\\n" call)*' if shape.parallel else "calls: call")
        rules.append(f'call: {open_} "\\n" call_json "\\n" {close}')
        rules.append(f"call_json: %json {json.dumps(call_schema)}")
    if shape.content == "text":
        answer = "TEXT? calls?" if shape.calls else "TEXT"
    elif shape.content is None:
        answer = "calls"
    else:
        answer = "content | calls" if shape.calls else "content"
    start = "start: answer"
    if shape.think != "off":
        # after the block free text absorbs the blank line itself; JSON and calls get a short gap
        gap = "" if shape.content == "text" else " GAP?"
        open_, close = shape.think_tags
        if shape.think_tokens:
            block = f"TEXT? {close}"
        else:
            rules.append(f"reasoning[stop={json.dumps(close)}]: /(.|\\n)*/")
            block, open_ = "reasoning", json.dumps(open_)
        if shape.think == "optional":
            start = f"start: ({open_} {block}{gap})? answer"
        else:
            start = f"start: {block}{gap} answer"
    lines = [start, f"answer: {answer}", *rules, "TEXT: /(.|\\n)+/", "GAP: /[ \\t\\r\\n]{1,4}/"]
    return "\n".join(lines) + "\n"


def call_schemas(tools: Any, choice: Any, *, strict_only: bool) -> tuple[dict[str, Any], ...]:
    """JSON schemas of the call objects ``tool_choice`` allows.

    A named ``choice`` keeps that tool only.  With ``strict_only`` (``auto``)
    a tool without ``strict: true`` keeps its name but its arguments are any
    JSON object; otherwise every tool's ``parameters`` schema applies.
    """
    if isinstance(choice, dict):
        wanted = choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == wanted]
    out = []
    for t in tools:
        fn = t["function"]
        enforce = fn.get("strict") or not strict_only
        params = (fn.get("parameters") or {"type": "object"}) if enforce else {"type": "object"}
        out.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return tuple(out)


def is_tag_token(tokenizer: Any, tag: str) -> bool:
    """Whether ``tag`` is one added token of the vocabulary (``<tool_call>``),
    so a grammar can name it as ``<tool_call>``."""
    hf = hf_tokenizer(tokenizer)
    added = _per_tokenizer(_ADDED, hf, lambda: frozenset(
        hf.get_added_vocab() if hasattr(hf, "get_added_vocab") else ()))
    return tag in added and tag.startswith("<") and tag.endswith(">") and ">" not in tag[1:-1]


def _ll_tokenizer(tokenizer: Any) -> Any:
    import llguidance.hf

    hf = hf_tokenizer(tokenizer)

    def build() -> Any:
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        return llguidance.hf.from_tokenizer(hf, eos_token=eos[0] if len(eos) == 1 else eos)

    return _per_tokenizer(_TOKENIZERS, hf, build)


def _per_tokenizer(cache: weakref.WeakKeyDictionary[Any, T], hf: Any, build: Callable[[], T]) -> T:
    """``cache[hf]``, built once (under the lock) on first use."""
    with _LOCK:
        value = cache.get(hf)
        if value is None:
            value = cache[hf] = build()
        return value


def grammar_processor(lark: str, tokenizer: Any, prompt_len: int) -> tuple[GrammarProcessor | None, bool]:
    """``(processor, downgraded)``: a logits processor enforcing ``lark``, or
    ``(None, True)`` when llguidance cannot compile it (best-effort)."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        ll = _ll_tokenizer(tokenizer)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll)
        if is_error:
            raise ValueError(messages[0] if messages else "invalid grammar")
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
    except Exception as exc:  # noqa: BLE001 - any compile failure downgrades
        log.warning("constrained output runs best-effort: %s", exc)
        return None, True
    return GrammarProcessor(matcher, prompt_len), False


class GrammarProcessor:
    """Logits processor masking tokens outside the grammar.

    Speculative decoding (``afm_core._mlx.speculative``) calls it at several
    positions of one verify step, each with the tokens before that position,
    after asking :meth:`valid_prefix` how much of its guess the grammar allows;
    :meth:`rollback` then forgets the guessed tokens the model did not accept."""

    def __init__(self, matcher: Any, prompt_len: int):
        self.matcher = matcher
        self.prompt_len = prompt_len
        self.consumed = 0
        """Generated tokens seen (fed to the matcher, or past its end: ``_unfed``)."""
        self._unfed = 0
        """The last of those the matcher did not take: it had stopped (see ``_catch_up``)."""
        self._mask: np.ndarray | None = None

    def _catch_up(self, tokens: Any) -> None:
        m = self.matcher
        generated = tokens.size - self.prompt_len
        if generated > self.consumed:
            new = tokens[self.prompt_len + self.consumed :].tolist()
            self.consumed = generated
            for i, t in enumerate(new):
                if m.is_stopped():
                    # the grammar is complete and ``t`` is the end of sequence:
                    # mlx-lm's pipelined step still runs once past it
                    self._unfed += len(new) - i
                    break
                if not m.consume_token(int(t)):
                    raise RuntimeError(f"grammar rejected the output: {m.get_error()}")

    def valid_prefix(self, tokens: Any, guess: list[int]) -> int:
        """How many tokens of ``guess`` the grammar allows after ``tokens``
        (the row's tokens so far, which it takes in as a call would)."""
        self._catch_up(tokens)
        if self.matcher.is_stopped():
            return 0
        n: int = self.matcher.validate_tokens(guess)
        return n

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens seen."""
        if n <= 0:
            return
        unfed = min(n, self._unfed)
        self._unfed -= unfed
        if n > unfed and not self.matcher.rollback(n - unfed):
            raise RuntimeError(f"grammar could not roll back {n - unfed} tokens: {self.matcher.get_error()}")
        self.consumed -= n

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import llguidance.numpy as llnp
        import mlx.core as mx

        self._catch_up(tokens)
        vocab = logits.shape[-1]
        if self._mask is None:
            self._mask = llnp.allocate_token_bitmask(1, vocab)
        llnp.fill_next_token_bitmask(self.matcher, self._mask)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
        allowed = np.zeros(vocab, dtype=bool)
        n = min(vocab, bits.size)
        allowed[:n] = bits[:n].astype(bool)
        return mx.where(mx.array(allowed)[None, :], logits, -mx.inf)
