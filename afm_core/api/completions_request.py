"""The legacy Completions API's request: one or several raw prompts, and a
frozen :class:`CompletionRequest` per prompt (the engine's raw-prompt request).

Sans-IO.  :func:`completion_prompts` reads a body's ``prompt`` (OpenAI's four
forms) and ``CompletionRequest.from_openai`` validates the settings for each
(the engine runs one request per prompt and choice); the sampler settings and
stop strings are validated as chat's are (:mod:`.chat_request`).  The
wire-only fields (``n``, ``best_of``, ``stream``, ``echo``) are the
translation's (:mod:`.completions`).

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._validate import err, flag, integer, json_object, optional_str, valid_text
from .chat_request import MAX_INT, MAX_TOP_LOGPROBS, adapter_field, sampling, seed_and_top_k

__all__ = ["MAX_PROMPT_ID", "CompletionRequest", "Prompt", "completion_prompts"]

MAX_PROMPT_ID = 2**31 - 1

Prompt = str | tuple[int, ...]
"""One raw prompt: text, or token ids used as given."""


def _prompt_ids(raw: list[Any], param: str) -> tuple[int, ...]:
    if not raw:
        raise err("a token-id prompt must not be empty", param)
    for i, t in enumerate(raw):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_PROMPT_ID:
            raise err("token ids must be non-negative integers", f"{param}[{i}]")
    return tuple(raw)


def _prompt_text(raw: str, param: str) -> str:
    if not raw:
        raise err("the prompt must not be empty", param)
    return valid_text(raw, param)


def completion_prompts(raw: Any) -> tuple[Prompt, ...]:
    """The prompts of a completions body's ``prompt``, in order.

    OpenAI's four forms: a string, a list of strings, a list of token ids (one
    prompt), a list of token-id lists; each prompt must be non-empty.
    """
    shape = "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(raw, str):
        return (_prompt_text(raw, "prompt"),)
    if not isinstance(raw, list) or not raw:
        raise err(shape, "prompt")
    if isinstance(raw[0], int):  # a list of token ids (one prompt)
        return (_prompt_ids(raw, "prompt"),)
    out: list[Prompt] = []
    for i, p in enumerate(raw):
        if isinstance(p, str):
            out.append(_prompt_text(p, f"prompt[{i}]"))
        elif isinstance(p, list):
            out.append(_prompt_ids(p, f"prompt[{i}]"))
        else:
            raise err(shape, f"prompt[{i}]")
    return tuple(out)


def _legacy_logprobs(body: dict[str, Any]) -> int | None:
    v = body.get("logprobs")
    if v is None or v is False:
        return None
    if v is True:
        raise err(f"'logprobs' is the number of alternatives to list per token (0-{MAX_TOP_LOGPROBS}) "
                   "in the completions API", "logprobs")
    return integer(body, "logprobs", 0, MAX_TOP_LOGPROBS, None)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One raw-prompt completion: the prompt is continued as is, without a chat template.

    ``prompt`` is text (tokenized with the tokenizer's special tokens, such as
    a BOS, unless ``add_special_tokens`` is False) or token ids, used as given.
    There are no reasoning, tool or structured-output stages: the output is
    plain text, cut by ``stop`` strings.  ``logprobs``/``top_logprobs`` score
    the generated tokens as in a chat request; ``prompt_logprobs`` (the number
    of alternatives per position, ``None`` for none) scores the prompt's own
    tokens too, which makes the engine prefill the whole prompt (no prefix
    cache) and compute its logits.  ``max_tokens`` may be 0 (nothing is
    generated; with ``prompt_logprobs`` the prompt is still scored);
    ``None`` allows the rest of the context.  ``ignore_eos`` generates to
    ``max_tokens`` through end-of-sequence tokens.  ``suffix`` asks for
    fill-in-the-middle: the model must have FIM tokens.
    """

    prompt: Prompt
    model: str | None = None
    suffix: str | None = None
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    add_special_tokens: bool = True
    adapter: str | None = None
    """The LoRA adapter to run with (see :attr:`ChatRequest.adapter`)."""

    @classmethod
    def from_openai(cls, body: Any, prompt: Prompt) -> CompletionRequest:
        """Validate an OpenAI completions body's settings for one of its prompts
        (see :func:`completion_prompts`).

        Legacy ``logprobs: k`` scores the generated tokens with ``k``
        alternatives each, and with ``echo: true`` the prompt's tokens too.
        ``max_tokens`` defaults to 16, as OpenAI's.  Also accepted:
        ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos`` and
        ``add_special_tokens`` (vLLM's extensions).  The wire-only fields
        (``n``, ``best_of``, ``stream``, ``stream_options``) are the
        translation's to check (:mod:`afm_core.api.completions`).
        """
        body = json_object(body)
        model = optional_str(body, "model")
        suffix = body.get("suffix")
        if suffix is not None:
            if not isinstance(suffix, str):
                raise err("'suffix' must be a string", "suffix")
            valid_text(suffix, "suffix")
        echo = flag(body, "echo", False)
        logprobs = _legacy_logprobs(body)
        seeded = seed_and_top_k(body)
        return cls(
            prompt=prompt,
            model=model,
            adapter=adapter_field(body),
            suffix=suffix,
            max_tokens=integer(body, "max_tokens", 0, MAX_INT, 16),
            **seeded,
            **sampling(body),
            logprobs=logprobs is not None,
            top_logprobs=logprobs or 0,
            prompt_logprobs=logprobs if echo else None,
            ignore_eos=flag(body, "ignore_eos", False),
            add_special_tokens=flag(body, "add_special_tokens", True),
        )
