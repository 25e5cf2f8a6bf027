"""Volatile lines: text clients put into their system prompts that changes
on every request and would otherwise keep two sessions from sharing a
prefix in the prefix cache.

Claude Code begins its system prompt with a line like
``x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=cli; cch=1f3a9;``
whose value differs per prompt: two sessions with the same 20k-token system
prompt and tools then share nothing.  The engine takes such lines out of
system text (``system`` / ``developer`` messages, which is where the
Anthropic route puts ``system`` blocks) before the chat template renders
the prompt, unless ``EngineConfig.keep_volatile_lines`` (``afm serve
--keep-volatile-lines``) is set.

:data:`VOLATILE_LINES` is the rule list: each pattern is matched against one
line (``re.fullmatch``); a line that matches is removed with its line
break.  Nothing else in the text changes.

May import :mod:`.chat_request` and the standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .chat_request import ChatRequest

__all__ = ["VOLATILE_LINES", "strip_volatile", "strip_volatile_lines", "strip_volatile_messages"]

VOLATILE_LINES: tuple[re.Pattern[str], ...] = (
    # Claude Code's per-prompt billing line (its first system block)
    re.compile(r"x-anthropic-billing-header:.*"),
)
"""The volatile-line rules: a system-text line matching one is removed."""

_SYSTEM_ROLES = ("system", "developer")


def strip_volatile_lines(text: str, rules: tuple[re.Pattern[str], ...] = VOLATILE_LINES) -> str:
    """``text`` without the lines a rule matches (with their line breaks)."""
    if not any(rule.search(text) for rule in rules):
        return text
    kept = [line for line in text.splitlines(keepends=True)
            if not any(rule.fullmatch(line.rstrip("\r\n")) for rule in rules)]
    return "".join(kept)


def _content(content: Any) -> Any:
    if isinstance(content, str):
        return strip_volatile_lines(content)
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part = {**part, "text": strip_volatile_lines(part["text"])}
            out.append(part)
        return out
    return content


def strip_volatile_messages(messages: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Chat ``messages`` with the volatile lines out of their system text."""
    return tuple({**m, "content": _content(m.get("content"))}
                 if m.get("role") in _SYSTEM_ROLES and "content" in m else m
                 for m in messages)


def strip_volatile(request: ChatRequest) -> ChatRequest:
    """``request`` without the volatile lines of its system text."""
    stripped = strip_volatile_messages(request.messages)
    if stripped == tuple(request.messages):
        return request
    return replace(request, messages=stripped)
