"""Turn a validated request into a generation job (runs in a Trio worker thread).

Chat templating, tokenization, context-length checks and the construction of
the stream's pipeline stages happen here, off the generation thread.
"""

from __future__ import annotations

from typing import Any

from ._errors import ContextLengthError, RequestError
from ._loader import ModelInfo
from ._pipeline import StreamPipeline
from ._profile import ProfileRecorder
from ._request import ChatRequest
from ._worker import Job


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
            tools=list(request.tools) if use_tools else None,
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


def _reasoning_stage(prompt_text: str, request: ChatRequest, info: ModelInfo) -> Any:
    if info.think_tags is None:
        return None
    from ._reasoning import ReasoningSplitter

    start, end = info.think_tags
    tail = prompt_text.rstrip()
    if tail.endswith(end):
        # the template closed the block (thinking off): all output is content
        return ReasoningSplitter(start, end, enabled=False)
    if request.enable_thinking is False:
        return ReasoningSplitter(start, end, enabled=False)
    return ReasoningSplitter(start, end, started=tail.endswith(start))


def _tool_stage(request: ChatRequest, info: ModelInfo) -> Any:
    if not request.tools or request.tool_choice == "none" or info.tool_format is None:
        return None
    from ._toolfmt import make_tool_tracker

    return make_tool_tracker(
        info.tool_format, tools=request.tools, parallel_tool_calls=request.parallel_tool_calls
    )


def _structured_stage(request: ChatRequest) -> Any:
    if request.response_format is None:
        return None
    from ._structured import make_structured_output

    return make_structured_output(request.response_format)


def build_job(request: ChatRequest, *, key: int, info: ModelInfo, tokenizer: Any, tables: Any,
              config: Any, profile: str | None, t_submit: float) -> tuple[Job, bool]:
    """``(job, grammar_downgraded)`` for ``request``; raises RequestError subclasses."""
    from ._detok import IncrementalDetokenizer

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
    grammar, downgraded = None, False
    forced = isinstance(request.tool_choice, dict) or request.tool_choice == "required"
    if forced and request.tools:
        # the call must happen: enforce it where the model's format allows
        if config.grammar and info.tool_format == "hermes":
            from ._grammar import tool_choice_processor

            grammar, downgraded = tool_choice_processor(request, tokenizer, len(prompt))
        else:
            downgraded = True
        if request.strict_schema is not None:
            downgraded = True  # one grammar per stream: the tool call wins
    elif request.strict_schema is not None:
        if config.grammar:
            from ._grammar import schema_processor

            grammar, downgraded = schema_processor(request.strict_schema, tokenizer, len(prompt))
        else:
            downgraded = True
    pipeline = StreamPipeline(
        IncrementalDetokenizer(tables),
        stops=request.stop,
        reasoning=_reasoning_stage(text, request, info),
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
