"""Strict JSON-schema output with llguidance token masks.

``schema_processor(schema, tokenizer, prompt_len)`` compiles the schema and
returns an mlx-lm logits processor that, before each sampling step, advances
an ``LLMatcher`` by the tokens generated so far and masks every token the
grammar forbids.  mlx-lm applies processors row by row inside the batched
step, so constrained and free streams share one batch.  A schema llguidance
cannot compile runs best-effort: ``(None, True)`` ("downgraded").
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import numpy as np

log = logging.getLogger("afm.grammar")

_LOCK = threading.Lock()
_TOKENIZERS: dict[int, Any] = {}


def _ll_tokenizer(tokenizer: Any) -> Any:
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    with _LOCK:
        ll = _TOKENIZERS.get(id(hf))
        if ll is None:
            eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
            ll = llguidance.hf.from_tokenizer(hf, eos_token=eos[0] if len(eos) == 1 else eos)
            _TOKENIZERS[id(hf)] = ll
        return ll


def compile_schema(schema: dict[str, Any], tokenizer: Any) -> tuple[Any, str | None]:
    """``(matcher, None)`` or ``(None, reason)`` when the schema cannot be enforced."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
    except Exception as exc:  # noqa: BLE001 - any compile failure downgrades
        return None, str(exc)
    return _matcher(grammar, tokenizer)


def hermes_tool_grammar(tools: Any, choice: Any, parallel: bool) -> str:
    """A Lark grammar forcing Hermes ``<tool_call>`` blocks for ``tool_choice``.

    ``choice`` is ``"required"`` (any of ``tools``) or ``{"function": {"name": ...}}``.
    ``<tool_call>`` / ``</tool_call>`` are the vocabulary's own tokens.
    """
    if isinstance(choice, dict):
        wanted = choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == wanted]
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
    # the model's own layout, and no runs of free whitespace to wander into
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ",
                            "key_separator": ": "}
    start = 'start: call ("\\n" call)*' if parallel and not isinstance(choice, dict) else "start: call"
    return (
        f"{start}\n"
        'call: <tool_call> "\\n" obj "\\n" </tool_call>\n'
        f"obj: %json {json.dumps(schema)}\n"
    )


def tool_choice_processor(request: Any, tokenizer: Any, prompt_len: int) -> tuple[Any, bool]:
    """``(processor, downgraded)`` forcing a call for ``required`` / named tool_choice."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark(
        hermes_tool_grammar(request.tools, request.tool_choice, request.parallel_tool_calls))
    matcher, reason = _matcher(grammar, tokenizer)
    if matcher is None:
        log.warning("tool_choice runs best-effort: %s", reason)
        return None, True
    return SchemaProcessor(matcher, prompt_len), False


def _matcher(grammar: str, tokenizer: Any) -> tuple[Any, str | None]:
    import llguidance

    try:
        ll = _ll_tokenizer(tokenizer)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll)
        if is_error:
            return None, messages[0] if messages else "invalid grammar"
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if matcher.is_error():
            return None, matcher.get_error()
        return matcher, None
    except Exception as exc:  # noqa: BLE001 - any compile failure downgrades
        return None, str(exc)


class SchemaProcessor:
    """Logits processor masking tokens outside the grammar."""

    def __init__(self, matcher: Any, prompt_len: int):
        self.matcher = matcher
        self.prompt_len = prompt_len
        self.consumed = 0
        self._mask: np.ndarray | None = None

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import llguidance.numpy as llnp
        import mlx.core as mx

        m = self.matcher
        generated = tokens.size - self.prompt_len
        if generated > self.consumed:
            new = tokens[self.prompt_len + self.consumed :].tolist()
            self.consumed = generated
            for t in new:
                if m.is_stopped():
                    # the grammar is complete and ``t`` is the end of sequence:
                    # mlx-lm's pipelined step still runs once past it
                    break
                if not m.consume_token(int(t)):
                    raise RuntimeError(f"grammar rejected the output: {m.get_error()}")
        vocab = logits.shape[-1]
        if self._mask is None:
            self._mask = llnp.allocate_token_bitmask(1, m.tokenizer.vocab_size if hasattr(m, "tokenizer") else vocab)
        llnp.fill_next_token_bitmask(m, self._mask)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
        allowed = np.zeros(vocab, dtype=bool)
        n = min(vocab, bits.size)
        allowed[:n] = bits[:n].astype(bool)
        return mx.where(mx.array(allowed)[None, :], logits, -mx.inf)


def schema_processor(schema: dict[str, Any], tokenizer: Any, prompt_len: int) -> tuple[Any, bool]:
    """``(processor, downgraded)`` for a strict schema."""
    matcher, reason = compile_schema(schema, tokenizer)
    if matcher is None:
        log.warning("strict schema runs best-effort: %s", reason)
        return None, True
    return SchemaProcessor(matcher, prompt_len), False
