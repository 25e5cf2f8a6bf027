"""Turn a validated request into a generation job (runs in a Trio worker thread).

Chat templating and tokenization (:mod:`.prompt`: the client's text never
becomes a control token), context-length checks and the construction of the
stream's pipeline stages happen here, off the generation thread.  A
:class:`CompletionRequest` skips the template: its raw prompt (text, or token
ids checked against the vocabulary; with a ``suffix``, the model's
fill-in-the-middle layout) is generated from directly, through the
detokenizer and stop strings only (no reasoning, tool or structured stages).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import AdapterNotFoundError, ContextLengthError, RequestError, UnsupportedError
from .._mlx.tokenizer import encode
from .._models.loader import ModelInfo
from .._stream.pipeline import StreamPipeline
from ..api.chat_request import ChatRequest
from ..api.completions_request import CompletionRequest
from ..api.volatile import strip_volatile, strip_volatile_lines
from . import grammar as g
from .commands import Job, JobKey
from .config import EngineConfig
from .grammar import ThinkMode
from .lanes import Ticket
from .profile import ProfileRecorder
from .prompt import chat_prompt, render_prompt

__all__ = ["build_job", "chat_prompt", "completion_prompt", "render_prompt"]

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .._stream.detok import DecoderTables

log = logging.getLogger("afm.grammar")

def think_mode(prompt_text: str, request: ChatRequest, info: ModelInfo) -> ThinkMode:
    """``off``, ``optional`` or ``started``: where the output stands towards a
    reasoning block (see :data:`afm_core._engine.grammar.ThinkMode`)."""
    if info.think_tags is None or request.enable_thinking is False:
        return "off"
    start, end = info.think_tags
    tail = prompt_text.rstrip()
    if tail.endswith(end):
        return "off"  # the template closed the block (thinking off): all output is content
    return "started" if tail.endswith(start) else "optional"


def _reasoning_stage(mode: ThinkMode, info: ModelInfo) -> Any:
    if info.think_tags is None:
        return None
    from .._stream.reasoning import ReasoningSplitter

    start, end = info.think_tags
    if mode == "off":
        return ReasoningSplitter(start, end, enabled=False)
    return ReasoningSplitter(start, end, started=mode == "started")


def _tool_stage(request: ChatRequest, info: ModelInfo) -> Any:
    if not request.tools or request.tool_choice == "none" or info.tool_format is None:
        return None
    from .._stream.toolcalls.registry import make_tool_tracker

    return make_tool_tracker(
        info.tool_format, tools=request.tools, parallel_tool_calls=request.parallel_tool_calls
    )


def _structured_stage(request: ChatRequest) -> Any:
    if request.response_format is None:
        return None
    from .._stream.structured import make_structured_output

    return make_structured_output(request.response_format)


def _constraints(request: ChatRequest, tokenizer: TokenizerWrapper, info: ModelInfo, config: EngineConfig,
                 prompt_len: int, mode: ThinkMode) -> tuple[g.GrammarProcessor | None, bool]:
    """``(grammar processor or None, downgraded)`` for what ``request`` asks to enforce.

    Enforced: a strict ``json_schema``; ``tool_choice`` ``required`` / named;
    ``auto`` with strict tools (free text or calls).  Tool grammars need the
    Hermes format with ``<tool_call>`` tokens; elsewhere they run best-effort.
    A grammar that cannot be enforced is the client's 400 (``GrammarError``).
    With ``config.enforce_json_modes`` the non-strict JSON modes (``json_object``,
    ``json_schema`` without ``strict``) are enforced too, best-effort: a schema
    that does not compile is generated unconstrained and marked downgraded.
    """
    loose = request.loose_schema if config.grammar and config.enforce_json_modes else None
    if loose is not None:
        try:
            return _enforce(request, tokenizer, info, prompt_len, mode, loose, loose=True)
        except g.GrammarError as exc:
            log.info("response_format generated unconstrained: %s", exc)
            grammar, _ = _enforce(request, tokenizer, info, prompt_len, mode, None, loose=False)
            return grammar, True
    if not config.grammar:
        tools = request.tools or ()
        choice = request.tool_choice
        asked = bool(tools) and (isinstance(choice, dict) or choice == "required"
                                 or (choice == "auto" and any(t["function"].get("strict") for t in tools)))
        return None, asked or request.strict_schema is not None
    return _enforce(request, tokenizer, info, prompt_len, mode, request.strict_schema, loose=False)


def _enforce(request: ChatRequest, tokenizer: TokenizerWrapper, info: ModelInfo, prompt_len: int,
             mode: ThinkMode, schema: dict[str, Any] | None, *,
             loose: bool) -> tuple[g.GrammarProcessor | None, bool]:
    """:func:`_constraints` with the grammar on, ``schema`` the content's (``loose``:
    a non-strict mode's, which forced tool calls leave aside without a mark)."""
    tools = request.tools or ()
    choice = request.tool_choice
    forced = bool(tools) and (isinstance(choice, dict) or choice == "required")
    strict_tools = choice == "auto" and any(t["function"].get("strict") for t in tools)
    if not (forced or strict_tools or schema is not None):
        return None, False
    calls: tuple[dict[str, Any], ...] = ()
    downgraded = False
    if forced or strict_tools:
        hermes = info.tool_format == "hermes" and all(
            g.is_tag_token(tokenizer, t) for t in ("<tool_call>", "</tool_call>"))
        if hermes:
            calls = g.call_schemas(tools, choice, strict_only=not forced)
        else:
            downgraded = True
            if schema is None:
                return None, True
    if forced:
        content: Any = None
        # the call must come: no JSON answer
        downgraded = downgraded or (schema is not None and not loose)
    else:
        content = schema if schema is not None else "text"
    think_tags = info.think_tags or ("<think>", "</think>")
    shape = g.OutputShape(
        content=content, calls=calls, parallel=request.parallel_tool_calls,
        think=mode,
        think_tags=think_tags,
        think_tokens=all(g.is_tag_token(tokenizer, t) for t in think_tags),
    )
    param = "response_format" if isinstance(content, dict) else "tools"
    g.check_shape(shape, tokenizer, param=param)
    return g.grammar_processor(g.output_grammar(shape), tokenizer, prompt_len, param=param), downgraded


def _within(info: ModelInfo, what: str, ticket: Ticket) -> Callable[[int], None]:
    """The check a prompt's tokenization makes between pieces: the ticket's
    (cancelled, deadline), and a :class:`ContextLengthError` as soon as the
    tokens so far leave no room in the context (the rest is not tokenized)."""
    ctx = info.context_length

    def check(count: int) -> None:
        ticket.check()
        if count >= ctx:
            raise ContextLengthError(
                f"this model's maximum context length is {ctx} tokens, but the {what} use "
                f"at least {count} tokens", param="messages" if what == "messages" else "prompt")

    return check


def _budget(prompt: list[int], requested: int | None, info: ModelInfo, config: EngineConfig,
            what: str) -> int:
    """The tokens ``prompt`` may generate: ``requested`` if the context has room."""
    ctx = info.context_length
    param = "messages" if what == "messages" else "prompt"
    if len(prompt) >= ctx:
        raise ContextLengthError(
            f"this model's maximum context length is {ctx} tokens, but the {what} use "
            f"{len(prompt)} tokens", param=param)
    room = ctx - len(prompt)
    if requested is not None:
        if requested > room:
            raise ContextLengthError(
                f"this model's maximum context length is {ctx} tokens; the {what} use "
                f"{len(prompt)} and max_tokens asks for {requested} more",
                param="max_tokens")
        return requested
    return room if config.default_max_tokens is None else min(room, config.default_max_tokens)


def build_job(request: ChatRequest | CompletionRequest, *, key: JobKey, info: ModelInfo,
              tokenizer: TokenizerWrapper, tables: DecoderTables, config: EngineConfig,
              profile: str | None, t_submit: float, progress: bool = False,
              ticket: Ticket | None = None) -> tuple[Job, bool]:
    """``(job, grammar_downgraded)`` for ``request``; raises RequestError subclasses.
    ``progress``: the job sends prompt-progress events (``Engine.stream``);
    ``ticket``: checked between the pieces of the work (:mod:`.lanes`)."""
    from .._stream.detok import IncrementalDetokenizer

    ticket = ticket or Ticket()

    recorder = None
    if profile is not None:
        recorder = ProfileRecorder(extended=profile == "extended", t_submit=t_submit,
                                   sample_interval=config.profile_sample_interval)
    adapter = adapter_index(request, config, info)
    if isinstance(request, CompletionRequest):
        prompt = completion_prompt(request, tokenizer, info, check=_within(info, "prompt", ticket))
        max_tokens = _budget(prompt, request.max_tokens, info, config, "prompt")
        # the output continues the prompt: no first-token treatment (a sentencepiece
        # decoder would strip the leading space of the first generated word)
        pipeline = StreamPipeline(IncrementalDetokenizer(continuation_tables(tables)), stops=request.stop)
        return Job(key=key, request=request, prompt=prompt, max_tokens=max_tokens, pipeline=pipeline,
                   profile=recorder, stop_at_eos=not request.ignore_eos,
                   prompt_top_logprobs=request.prompt_logprobs, progress=progress, adapter=adapter), False
    if not config.keep_volatile_lines:
        request = strip_volatile(request)
    prompt, text = chat_prompt(request, tokenizer, info, check=_within(info, "messages", ticket))
    ticket.check()
    if not prompt:
        raise RequestError("the rendered prompt is empty", param="messages")
    max_tokens = _budget(prompt, request.max_tokens, info, config, "messages")
    mode = think_mode(text, request, info)
    ticket.check()
    grammar, downgraded = _constraints(request, tokenizer, info, config, len(prompt), mode)
    pipeline = StreamPipeline(
        IncrementalDetokenizer(tables),
        stops=request.stop,
        reasoning=_reasoning_stage(mode, info),
        tools=_tool_stage(request, info),
        structured=_structured_stage(request),
    )
    breakpoints = cache_breakpoints(request, prompt, tokenizer, info, config, ticket)
    job = Job(key=key, request=request, prompt=prompt, max_tokens=max_tokens, breakpoints=breakpoints,
              pipeline=pipeline, profile=recorder, grammar=grammar, progress=progress, adapter=adapter)
    return job, downgraded


MAX_BREAKPOINTS = 4


def cache_breakpoints(request: ChatRequest, prompt: list[int], tokenizer: TokenizerWrapper, info: ModelInfo,
                      config: EngineConfig, ticket: Ticket) -> tuple[tuple[int, float], ...]:
    """``request``'s cache breakpoints as ``(prompt tokens, ttl)``: each
    breakpoint's part of the conversation rendered alone (no generation
    prompt) and tokenized; its tokens are those it shares with ``prompt``
    from the start (a template that renders that part otherwise, or not as a
    prefix, gives fewer, never more).  A part the template cannot render
    alone (no messages, say) is no breakpoint.  The last :data:`MAX_BREAKPOINTS`
    count (Anthropic's limit; each costs a rendering and a tokenization)."""
    if not request.cache_breakpoints or (config.prefix_cache_bytes == 0 and config.cache_dir is None):
        return ()
    out: dict[int, float] = {}
    seen: dict[tuple[int, str | None, int | None], int] = {}
    for bp in request.cache_breakpoints[-MAX_BREAKPOINTS:]:
        part = (bp.messages, bp.system, bp.tools)
        if part not in seen:
            messages = list(request.messages[: bp.messages])
            if bp.system is not None and messages and messages[0].get("role") == "system":
                system = bp.system if config.keep_volatile_lines else strip_volatile_lines(bp.system)
                messages[0] = {**messages[0], "content": system}
            tools = request.tools[: bp.tools] if request.tools is not None and bp.tools is not None \
                else request.tools
            alone = dataclasses.replace(request, messages=tuple(messages), tools=tools or None)
            try:
                ids, _ = chat_prompt(alone, tokenizer, info, check=_within(info, "messages", ticket),
                                     generation_prompt=False)
            except RequestError:
                ids = []
            shared = 0
            for a, b in zip(ids, prompt, strict=False):
                if a != b:
                    break
                shared += 1
            seen[part] = min(shared, len(prompt) - 1)
        n = seen[part]
        if n > 0:
            out[n] = max(out.get(n, 0.0), bp.ttl)
    return tuple(sorted(out.items()))


def adapter_index(request: ChatRequest | CompletionRequest, config: EngineConfig, info: ModelInfo) -> int:
    """The request's LoRA adapter as an index into ``config.adapters`` plus one
    (0: none); raises :class:`AdapterNotFoundError` for a name not served.

    ``adapter`` (the body's ``adapters``) names one; so does a ``model`` of the
    form ``base:name``.  A ``model`` holding ``:`` whose tail is no adapter is
    still a plain model name when the engine serves no adapters and the head is
    not this model's id (a client's ``llama3:8b`` sent to a one-model server).
    """
    names = [name for name, _ in config.adapters]
    wanted = request.adapter
    if wanted is not None:
        for i, (name, path) in enumerate(config.adapters):
            if wanted in (name, path):  # mlx_lm.server's field holds a path
                return i + 1
        raise AdapterNotFoundError(f"The adapter '{wanted}' is not served here: GET /v1/models lists "
                                   "them as model:adapter", param="adapters")
    model = request.model or ""
    head, colon, tail = model.rpartition(":")
    if not colon:
        return 0
    if tail in names:
        return names.index(tail) + 1
    if names or head == info.id:
        raise AdapterNotFoundError(f"The adapter '{tail}' is not served here: GET /v1/models lists "
                                   "them as model:adapter")
    return 0


# -- raw prompts ------------------------------------------------------------------

FIM_TOKENS: tuple[tuple[str, str, str], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, Granite
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),  # DeepSeek
    ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>"),  # CodeLlama
    ("<PRE>", "<SUF>", "<MID>"),
    ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"),  # GLM-4.5
)
"""Fill-in-the-middle (prefix, suffix, middle) token spellings, as llama.cpp
recognises them in a vocabulary (``llama-vocab.cpp``)."""


def fim_tokens(tokenizer: Any) -> tuple[int, int, int] | None:
    """The ids of the model's (prefix, suffix, middle) FIM tokens, or None
    when its vocabulary has no complete set."""
    from .._stream.detok_tables import backend_tokenizer

    backend = backend_tokenizer(tokenizer)
    for names in FIM_TOKENS:
        ids = [backend.token_to_id(n) for n in names]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]
    return None


def continuation_tables(tables: DecoderTables) -> DecoderTables:
    """``tables`` for text that continues a prompt: no first-token variants,
    no leading strip (both sentencepiece-only; byte-level tables are as is)."""
    if not tables.first_texts and not tables.strip_count:
        return tables
    return dataclasses.replace(tables, first_texts={}, strip_count=0)


def completion_prompt(request: CompletionRequest, tokenizer: Any, info: ModelInfo,
                      check: Callable[[int], None] | None = None) -> list[int]:
    """The token ids a completion generates from; raises RequestError.  ``check``
    runs between the pieces of a long text's tokenization (:func:`encode`)."""
    raw = request.prompt
    limit = min(info.vocab_size, len(tokenizer))
    if isinstance(raw, str):
        ids = encode(tokenizer, raw, add_special_tokens=request.add_special_tokens, check=check)
    else:
        ids = list(raw)
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < limit), None)
        if bad is not None:
            raise RequestError(f"token id {ids[bad]} is not in the model's vocabulary (0-{limit - 1})",
                               param=f"prompt[{bad}]")
    if request.suffix is not None:
        fim = fim_tokens(tokenizer)
        if fim is None:
            raise UnsupportedError(f"'suffix' needs a model with fill-in-the-middle tokens; "
                                   f"{info.id} has none", param="suffix")
        pre, suf, mid = fim
        if isinstance(raw, str):
            ids = encode(tokenizer, raw, check=check)
        lead: list[int] = []
        bos = getattr(tokenizer, "bos_token_id", None)
        if request.add_special_tokens and bos is not None \
                and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]:
            lead = [bos]
        suffix = list(tokenizer.encode(request.suffix, add_special_tokens=False))
        ids = [*lead, pre, *ids, suf, *suffix, mid]
    if not ids:
        raise RequestError("the prompt is empty once tokenized", param="prompt")
    return ids
