"""Grammar-constrained output with llguidance token masks.

One assistant turn is described as an :class:`OutputShape` (an optional
reasoning block, then free text, a JSON document, tool calls, or text
followed by calls) and rendered as an llguidance Lark grammar by
:func:`output_grammar`.  :func:`grammar_processor` compiles it and returns an
mlx-lm logits processor that, before each sampling step, advances an
``LLMatcher`` by the tokens generated so far and masks every token the
grammar forbids.  mlx-lm applies processors row by row inside the batched
step, so constrained and free streams share one batch.

A grammar is the client's: one llguidance cannot compile, or that exceeds
its resource limits (Earley items per row and per step, lexer fuel and
states, grammar size), is the client's 400 (:class:`GrammarError`, a short
message, never the grammar's text), decided before generation so that the
answer does not depend on what the model samples: :func:`grammar_processor`
compiles the grammar (one beyond :data:`MAX_GRAMMAR_CHARS` is refused
outright) and, on a copy of the matcher, computes the first mask
and follows the bytes the grammar forces (``{"`` of a JSON object, the
``<tool_call>`` of a forced call) while it forces any, computing each mask
on the way (:func:`_probe`); :func:`check_shape` does the same for the
answer's JSON document and its calls alone, without the optional reasoning
block or free text that could otherwise put them off.  A limit hit later
during generation (a deeper nesting than the probe reached) ends that
stream with a :class:`GrammarFailure` (``invalid_request_error``,
``grammar_too_complex``) instead of a server error.

What gets enforced (see ``_prepare.build_job``):

* ``response_format`` ``json_schema`` with ``strict: true``: the content is
  one JSON document of that schema; with ``enforce_json_modes`` (the
  default) also ``json_object`` (any JSON object) and a ``json_schema``
  without ``strict``, best-effort (what cannot compile runs unconstrained,
  marked downgraded, instead of the 400);
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

from .._errors import RequestError
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

PROBE_ROUNDS = 16
"""Forced steps :func:`_probe` follows at most."""

MAX_GRAMMAR_CHARS = 256 << 10
"""A grammar (its Lark text: the schema's JSON, the tools' schemas) beyond this
is a 400 ``grammar_too_large``: compiling one costs time in proportion (a
780 KB regex took 2 s), and strict schemas are small (OpenAI caps theirs
around 120,000 characters of names and values)."""

ERROR_CHARS = 300
"""A grammar error's message is cut to this many characters."""


class GrammarError(RequestError):
    """A grammar the engine cannot enforce (invalid, or beyond llguidance's limits): a 400."""

    code = "invalid_grammar"


class GrammarFailure(RuntimeError):
    """The grammar could not go on during generation (a resource limit reached
    at a state the probe did not reach); the stream ends with this message."""


def short_error(message: str) -> str:
    """llguidance's error as one short line: no parser state, no grammar text."""
    first = message.strip().split("\n", 1)[0]
    for cut in ("<state>", "<grammar>"):
        first = first.split(cut, 1)[0]
    return first[:ERROR_CHARS].rstrip() or "invalid grammar"


def _limits() -> Any:
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


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
        defs: dict[str, Any] = {}
        calls = []
        for call in shape.calls:  # their $defs (rebased parameters) go to the root
            call = dict(call)
            defs.update(call.pop("$defs", None) or {})
            calls.append(call)
        call_schema: dict[str, Any] = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
        if defs:
            call_schema["$defs"] = defs
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
    for i, t in enumerate(tools):
        fn = t["function"]
        enforce = fn.get("strict") or not strict_only
        params = (fn.get("parameters") or {"type": "object"}) if enforce else {"type": "object"}
        call: dict[str, Any] = {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        if _has_local_ref(params):
            # its "#..." references point into the parameters: moved under the call
            # grammar's root as $defs/tool<i>, they are rebased there
            base = f"/$defs/tool{i}"
            call["properties"]["arguments"] = {"$ref": f"#{base}"}
            call["$defs"] = {f"tool{i}": _rebase(params, base)}
        out.append(call)
    return tuple(out)


def _has_local_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_local_ref(v) for v in schema)
    return False


def _rebase(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#``, ``#/$defs/x``) prefixed by ``base``."""
    if isinstance(schema, dict):
        return {k: ("#" + base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebase(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase(v, base) for v in schema]
    return schema


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


def grammar_processor(lark: str, tokenizer: Any, prompt_len: int, *,
                      param: str | None = None) -> GrammarProcessor:
    """A logits processor enforcing ``lark``; :class:`GrammarError` (with
    ``param``) when llguidance cannot compile it or its probe (see the module
    docstring) hits a limit."""
    return GrammarProcessor(_matcher(lark, tokenizer, param), prompt_len)


def check_shape(shape: OutputShape, tokenizer: Any, *, param: str | None = None) -> None:
    """:class:`GrammarError` unless the JSON document and the calls ``shape``
    allows can each be enforced from their start (probed alone: without a
    reasoning block or free text in front, which could defer a failure)."""
    from dataclasses import replace

    parts = []
    if isinstance(shape.content, dict):
        parts.append(replace(shape, content=shape.content, calls=(), think="off"))
    if shape.calls:
        parts.append(replace(shape, content=None, think="off"))
    for part in parts:
        if part != shape:  # (the shape itself is probed when its processor is built)
            _matcher(output_grammar(part), tokenizer, param)


def _matcher(lark: str, tokenizer: Any, param: str | None) -> Any:
    import llguidance

    if len(lark) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the schema is too large to enforce: its grammar has {len(lark)} characters, "
                           f"more than {MAX_GRAMMAR_CHARS}", param=param, code="grammar_too_large")
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        ll = _ll_tokenizer(tokenizer)
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise GrammarError(f"the output grammar is invalid: {short_error(matcher.get_error())}",
                               param=param)
        _probe(matcher.deep_copy(), ll.vocab_size, param)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the compiler raises is the grammar's fault
        raise GrammarError(f"the output grammar is invalid: {short_error(str(exc))}", param=param) from None
    return matcher


def _probe(matcher: Any, vocab: int, param: str | None) -> None:
    """Compute masks along the bytes the grammar forces from its start (a copy
    of the matcher: the real one starts fresh); :class:`GrammarError` on a limit."""
    import llguidance.numpy as llnp

    mask = llnp.allocate_token_bitmask(1, vocab)
    for _ in range(PROBE_ROUNDS):
        llnp.fill_next_token_bitmask(matcher, mask)
        forced = [] if matcher.is_error() or matcher.is_stopped() else matcher.compute_ff_tokens()
        if forced and not matcher.consume_tokens(forced):
            break
        if matcher.is_error() or not forced:
            break
    if matcher.is_error():
        raise GrammarError("the output grammar is too complex to enforce: "
                           f"{short_error(matcher.get_error())}", param=param, code="grammar_too_complex")


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
                    raise GrammarFailure("the output grammar could not go on: "
                                         f"{short_error(m.get_error())}")

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
            raise GrammarFailure(f"the output grammar could not roll back {n - unfed} tokens: "
                                 f"{short_error(self.matcher.get_error())}")
        self.consumed -= n

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import llguidance.numpy as llnp
        import mlx.core as mx

        self._catch_up(tokens)
        vocab = logits.shape[-1]
        if self._mask is None:
            self._mask = llnp.allocate_token_bitmask(1, vocab)
        llnp.fill_next_token_bitmask(self.matcher, self._mask)
        if self.matcher.is_error():
            raise GrammarFailure(f"the output grammar could not go on: {short_error(self.matcher.get_error())}")
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
        allowed = np.zeros(vocab, dtype=bool)
        n = min(vocab, bits.size)
        allowed[:n] = bits[:n].astype(bool)
        return mx.where(mx.array(allowed)[None, :], logits, -mx.inf)
