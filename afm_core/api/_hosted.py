"""Tool types that are not plain function tools, shared by the parsers.

Sans-IO.  Agents send tools that the hosted APIs run themselves (OpenAI's
``web_search``, ``file_search``, ``code_interpreter`` ...; Anthropic's server
tools such as ``web_search_20250305``), and tools afm can only emit as
function calls (``custom``, ``local_shell``, ``shell``, ``apply_patch``).
afm runs none of them: they are not offered to the model, never cause a 400,
and the response names them in the ``X-AFM-Skipped-Tools`` header
(:data:`SKIPPED_HEADER`, :attr:`ChatRequest.skipped_tools`).  An unknown tool
type stays a 400 (a typo is not silently dropped).

Responses' ``namespace`` tools (a group of function tools under a name,
which Codex sends) are flattened by the Responses parser: each function is
offered as ``<namespace>__<name>`` (:func:`joined`, the flat name Codex
itself uses where a namespace cannot be kept), a name valid in every
function-calling template, and a call to it goes back out as ``name`` and
``namespace``, the fields of OpenAI's ``function_call`` item.
"""

from __future__ import annotations

__all__ = ["ANTHROPIC_SERVER_PREFIXES", "NAMESPACE_SEPARATOR", "OPENAI_SKIPPED", "SKIPPED_HEADER",
           "anthropic_server_tool", "joined"]

SKIPPED_HEADER = "X-AFM-Skipped-Tools"
"""The response header listing the tool types (``namespace.name`` for a
skipped tool inside a namespace) not offered to the model, comma-separated."""

NAMESPACE_SEPARATOR = "__"

OPENAI_SKIPPED = frozenset({
    # hosted: OpenAI's servers run them
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "file_search", "code_interpreter", "image_generation", "computer", "computer_use",
    "computer_use_preview", "mcp", "tool_search", "programmatic_tool_calling",
    # run by the client, but called with items afm does not emit (custom_tool_call,
    # local_shell_call, shell_call, apply_patch_call)
    "custom", "local_shell", "shell", "apply_patch",
})
"""The OpenAI tool types (Responses, and Chat Completions' ``custom``) that are skipped."""

ANTHROPIC_SERVER_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_",
                             "mcp_toolset")
"""Anthropic's server tools (their types carry a version date: ``web_search_20250305``);
the client tools with a type (``bash_*``, ``text_editor_*``, ``computer_*``,
``memory_*``) are not among them."""


def anthropic_server_tool(kind: object) -> bool:
    """``kind`` is the type of one of Anthropic's server tools (run by Anthropic)."""
    return isinstance(kind, str) and kind.startswith(ANTHROPIC_SERVER_PREFIXES)


def joined(namespace: str, name: str) -> str:
    """The function name a namespaced tool is offered to the model under: Codex's
    flat name for it (codex-rs ``ToolName::canonical_flat_name``: underscores next
    to the separator are trimmed), so a flat call reads the same on both sides."""
    return f"{namespace.rstrip('_')}{NAMESPACE_SEPARATOR}{name.lstrip('_')}"
