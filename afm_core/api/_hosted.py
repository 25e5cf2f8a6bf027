"""Tool types that are not plain function tools, shared by the parsers.

Sans-IO.  Agents send tools that the hosted APIs run themselves (OpenAI's
``web_search``, ``file_search``, ``code_interpreter`` ...; Anthropic's server
tools such as ``web_search_20250305``), and tools afm can only emit as
function calls (``custom``, ``local_shell``, ``shell``, ``apply_patch``).
afm runs none of them: they are not offered to the model, never cause a 400,
and the response names them in the ``X-AFM-Skipped-Tools`` header
(:data:`SKIPPED_HEADER`, :attr:`ChatRequest.skipped_tools`).  An unknown tool
type stays a 400 (a typo is not silently dropped).

Anthropic's typed client tools (``bash_20250124``, ``text_editor_*``:
:data:`ANTHROPIC_CLIENT_TOOLS`) are run by the client under names and inputs
Anthropic fixes: they are offered as the function tools they are.

Responses' ``namespace`` tools (a group of function tools under a name,
which Codex sends) are flattened by the Responses parser: each function is
offered as ``<namespace>__<name>`` (:func:`joined`, the flat name Codex
itself uses where a namespace cannot be kept), a name valid in every
function-calling template, and a call to it goes back out as ``name`` and
``namespace``, the fields of OpenAI's ``function_call`` item.
"""

from __future__ import annotations

__all__ = ["ANTHROPIC_CLIENT_TOOLS", "ANTHROPIC_SERVER_PREFIXES", "NAMESPACE_SEPARATOR", "OPENAI_SKIPPED",
           "SKIPPED_HEADER", "anthropic_client_tool", "anthropic_server_tool", "joined"]

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


_PATH = {"type": "string", "description": "Absolute path of the file or directory."}
_EDITOR_COMMANDS = ["view", "create", "str_replace", "insert"]


def _editor(commands: list[str]) -> dict[str, object]:
    return {
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": commands, "description": "The edit to make."},
            "path": _PATH,
            "file_text": {"type": "string", "description": "create: the new file's content."},
            "old_str": {"type": "string", "description": "str_replace: the exact text to replace "
                                                           "(it must occur once)."},
            "new_str": {"type": "string", "description": "str_replace: the replacement; insert: "
                                                           "the text to insert."},
            "insert_line": {"type": "integer", "description": "insert: the line after which to "
                                                               "insert (0: at the top)."},
            "view_range": {"type": "array", "items": {"type": "integer"},
                           "description": "view: [first, last] line numbers (last -1: to the end)."},
        },
        "required": ["command", "path"],
    }


_EDITOR_TEXT = ("View, create and edit files: view shows a file with line numbers (or a "
                "directory's entries), create writes a new file, str_replace replaces one "
                "exact occurrence of old_str with new_str, insert adds new_str after insert_line.")
ANTHROPIC_CLIENT_TOOLS: dict[str, tuple[str, str, dict[str, object]]] = {
    "bash_20250124": ("bash", "Run a command in a persistent bash shell and see its output; "
                              "restart: true restarts the shell.", {
        "type": "object",
        "properties": {"command": {"type": "string", "description": "The command to run."},
                       "restart": {"type": "boolean", "description": "Restart the shell."}},
    }),
    "text_editor_20250124": ("str_replace_editor", _EDITOR_TEXT + " undo_edit reverts the last edit.",
                             _editor([*_EDITOR_COMMANDS, "undo_edit"])),
    "text_editor_20250429": ("str_replace_based_edit_tool", _EDITOR_TEXT, _editor(_EDITOR_COMMANDS)),
    "text_editor_20250728": ("str_replace_based_edit_tool", _EDITOR_TEXT, _editor(_EDITOR_COMMANDS)),
}
"""Anthropic's client tools with a type (the client runs them; Anthropic fixes their
name and input): ``type: (the name it must have, a description, the input schema)``.
Offered to the model as the function tools they are; their calls come back as
``tool_use`` blocks under that name.  (``computer_*`` and ``memory_*`` are beta
types, not among them.)"""


def anthropic_client_tool(kind: str, name: object, tool: dict[str, object]) -> dict[str, object]:
    """The function tool one of :data:`ANTHROPIC_CLIENT_TOOLS` is offered as.
    Raises ``ValueError`` (the message names the field's problem) for a wrong name."""
    fixed, text, schema = ANTHROPIC_CLIENT_TOOLS[kind]
    if name != fixed:
        raise ValueError(f"Input should be '{fixed}'")
    limit = tool.get("max_characters")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        text += f" A view shows at most {limit} characters of a file."
    return {"name": fixed, "description": text, "parameters": schema}
