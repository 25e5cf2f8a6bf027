"""Turn a validated request into a generation job (runs in a Trio worker thread).

Chat templating, tokenization, context-length checks and the construction of
the stream's pipeline stages happen here, off the generation thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import ContextLengthError, RequestError
from .._models.loader import ModelInfo
from .._stream.pipeline import StreamPipeline
from .._stream.request import ChatRequest
from . import grammar as g
from .commands import Job, JobKey
from .config import EngineConfig
from .grammar import ThinkMode
from .profile import ProfileRecorder

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .._stream.detok import DecoderTables


def render_prompt(request: ChatRequest, tokenizer: Any, info: ModelInfo) -> str:
    use_tools = bool(request.tools) and request.tool_choice != "none"
    kwargs: dict[str, Any] = dict(request.chat_template_kwargs)
    if request.enable_thinking is not None:
        kwargs["enable_thinking"] = request.enable_thinking
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    messages = [dict(m) for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=list(request.tools) if use_tools and request.tools else None,
            add_generation_prompt=True,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - template errors are the request's
        raise RequestError(f"the chat template could not render these messages: {exc}",
                           param="messages") from None
    if not isinstance(text, str):
        raise RequestError("the chat template did not produce text", param="messages")
    return text


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
    """``(grammar processor or None, downgraded)`` for what ``request`` makes strict.

    Enforced: a strict ``json_schema``; ``tool_choice`` ``required`` / named;
    ``auto`` with strict tools (free text or calls).  Tool grammars need the
    Hermes format with ``<tool_call>`` tokens; elsewhere they run best-effort.
    """
    tools = request.tools or ()
    choice = request.tool_choice
    forced = bool(tools) and (isinstance(choice, dict) or choice == "required")
    strict_tools = choice == "auto" and any(t["function"].get("strict") for t in tools)
    schema = request.strict_schema
    if not (forced or strict_tools or schema is not None):
        return None, False
    if not config.grammar:
        return None, True
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
        downgraded = downgraded or schema is not None  # the call must come: no JSON answer
    else:
        content = schema if schema is not None else "text"
    think_tags = info.think_tags or ("<think>", "</think>")
    shape = g.OutputShape(
        content=content, calls=calls, parallel=request.parallel_tool_calls,
        think=mode,
        think_tags=think_tags,
        think_tokens=all(g.is_tag_token(tokenizer, t) for t in think_tags),
    )
    grammar, failed = g.grammar_processor(g.output_grammar(shape), tokenizer, prompt_len)
    return grammar, downgraded or failed


def build_job(request: ChatRequest, *, key: JobKey, info: ModelInfo, tokenizer: TokenizerWrapper,
              tables: DecoderTables, config: EngineConfig, profile: str | None,
              t_submit: float) -> tuple[Job, bool]:
    """``(job, grammar_downgraded)`` for ``request``; raises RequestError subclasses."""
    from .._stream.detok import IncrementalDetokenizer

    text = render_prompt(request, tokenizer, info)
    prompt = list(tokenizer.encode(text, add_special_tokens=False))
    if not prompt:
        raise RequestError("the rendered prompt is empty", param="messages")
    ctx = info.context_length
    if len(prompt) >= ctx:
        raise ContextLengthError(
            f"this model's maximum context length is {ctx} tokens, but the messages use "
            f"{len(prompt)} tokens", param="messages")
    room = ctx - len(prompt)
    if request.max_tokens is not None:
        if request.max_tokens > room:
            raise ContextLengthError(
                f"this model's maximum context length is {ctx} tokens; the messages use "
                f"{len(prompt)} and max_tokens asks for {request.max_tokens} more",
                param="max_tokens")
        max_tokens = request.max_tokens
    else:
        max_tokens = room if config.default_max_tokens is None else min(room, config.default_max_tokens)
    mode = think_mode(text, request, info)
    grammar, downgraded = _constraints(request, tokenizer, info, config, len(prompt), mode)
    pipeline = StreamPipeline(
        IncrementalDetokenizer(tables),
        stops=request.stop,
        reasoning=_reasoning_stage(mode, info),
        tools=_tool_stage(request, info),
        structured=_structured_stage(request),
    )
    recorder = None
    if profile is not None:
        recorder = ProfileRecorder(extended=profile == "extended", t_submit=t_submit,
                                   sample_interval=config.profile_sample_interval)
    job = Job(key=key, request=request, prompt=prompt, max_tokens=max_tokens,
              pipeline=pipeline, profile=recorder, grammar=grammar)
    return job, downgraded
