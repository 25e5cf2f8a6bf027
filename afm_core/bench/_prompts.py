"""Long, realistic prompts for the time-to-first-token phases of ``--real-model``.

What agents send: a system prompt with instructions and tool definitions
(JSON schemas, as a coding agent's), then source files and a task.  The text
is deterministic and offline: the instructions and the twelve tools are
written here; the code is a fixed list of Python standard-library modules
(``STDLIB_FILES``, read from this interpreter's ``stdlib``: the same bytes for
a given Python version; the report records the version and a digest of every
prompt), falling back to generated code when a file is missing.

``calibrated_messages`` fits a prompt to a number of tokens of a given
model: a binary search over how many lines of code it holds, counting the
chat-templated prompt with the model's own tokenizer (``count``: the
mlx-lm tokenizer of afm's converted directory, or llama.cpp's
``/apply-template`` and ``/tokenize``).  Prompts under 2,048 tokens get a
one-line system prompt (the agent prompt alone is about 1,500 tokens).

Every prompt starts with a session line unique to its request
(``session SEED-INDEX``), so no prefix cache of any server can reuse the
previous request's work: the first few tokens already differ.  The servers'
caches are also turned off (see ``_real``); the two together make each time
to first token a full prefill.  The files rotate with the request index, so
two requests share no long run of text either.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Awaitable, Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

Messages = list[dict[str, str]]
Counter = Callable[[Messages], Awaitable[int]]

#: Modules of Python's standard library used as the code in long prompts.
STDLIB_FILES: tuple[str, ...] = (
    "textwrap.py", "shlex.py", "heapq.py", "bisect.py", "graphlib.py", "string.py",
    "fractions.py", "calendar.py", "statistics.py", "ipaddress.py", "difflib.py",
)

AGENT_THRESHOLD = 2048
"""Prompts of at least this many tokens carry the full agent system prompt."""

_INSTRUCTIONS = """\
You are a senior software engineer working as an autonomous coding agent inside the user's
repository. You read code before you change it, you make the smallest change that solves the
task, and you verify your work by running the tests. Follow these rules:

1. Understand the task first. Restate it in one sentence, then list the files you need to read.
2. Never guess the contents of a file: read it with the read_file tool. Never invent APIs.
3. Prefer editing existing code over adding new modules. Keep functions short and named well.
4. After every change run the relevant tests with run_tests; if they fail, read the failure,
   fix the cause and run them again. Do not disable or weaken a test to make it pass.
5. Keep the user's style: indentation, quoting, naming, docstrings and comment density.
6. When a command could destroy data (deleting files, force-pushing, dropping tables), ask the
   user with ask_user first and wait for the answer.
7. Report at the end: what you changed, why, how you verified it, and what is left to do.
8. Be concise. No filler, no apologies, no restating the question at length.

When you call a tool, answer with exactly one JSON object of the form
{"tool": "<name>", "arguments": {...}} and nothing else; the result comes back in the next
message. You may call several tools in a row. When you are done, answer in plain text."""

_TOOLS: tuple[tuple[str, str, dict[str, str], tuple[str, ...]], ...] = (
    ("read_file", "Read a text file of the repository, optionally a range of lines.",
     {"path": "string: the file's path relative to the repository root",
      "start_line": "integer: first line to return (1-based)",
      "end_line": "integer: last line to return (inclusive)"}, ("path",)),
    ("write_file", "Create or overwrite a file with the given content.",
     {"path": "string: the file's path", "content": "string: the complete new content"},
     ("path", "content")),
    ("edit_file", "Replace one exact, unique occurrence of a string in a file.",
     {"path": "string: the file's path", "old": "string: the exact text to replace",
      "new": "string: the replacement"}, ("path", "old", "new")),
    ("list_dir", "List the entries of a directory, with sizes.",
     {"path": "string: the directory", "recursive": "boolean: descend into subdirectories",
      "max_entries": "integer: stop after this many"}, ("path",)),
    ("grep", "Search the repository for a regular expression.",
     {"pattern": "string: a Python regular expression", "path": "string: where to search",
      "glob": "string: only files matching this glob", "context": "integer: lines around hits"},
     ("pattern",)),
    ("run_shell", "Run a shell command in the repository and return its output.",
     {"command": "string: the command line", "timeout_s": "integer: seconds before it is killed",
      "cwd": "string: working directory"}, ("command",)),
    ("run_tests", "Run the project's tests, or a subset of them.",
     {"selector": "string: a test file, class or function (pytest syntax)",
      "verbose": "boolean: show every test", "fail_fast": "boolean: stop at the first failure"},
     ()),
    ("git_diff", "Show the uncommitted changes, or those of a commit.",
     {"commit": "string: a commit id (default: the working tree)",
      "paths": "array of strings: limit to these paths"}, ()),
    ("git_commit", "Commit the staged changes with a message.",
     {"message": "string: the commit message", "all": "boolean: stage every tracked change first"},
     ("message",)),
    ("search_code", "Find definitions and references of a symbol.",
     {"symbol": "string: a function, class or variable name",
      "kind": "string: one of definition, reference, both"}, ("symbol",)),
    ("fetch_docs", "Fetch the documentation page of a library's API.",
     {"package": "string: the package name", "topic": "string: a module, class or function"},
     ("package",)),
    ("ask_user", "Ask the user a question and wait for the answer.",
     {"question": "string: the question, one or two sentences"}, ("question",)),
)


def _tool_schema(name: str, description: str, props: dict[str, str],
                 required: Sequence[str]) -> dict[str, Any]:
    properties = {}
    for key, text in props.items():
        kind, _, desc = text.partition(": ")
        if kind.startswith("array"):
            properties[key] = {"type": "array", "items": {"type": "string"}, "description": desc}
        else:
            properties[key] = {"type": kind, "description": desc}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(required)}}}


@lru_cache(maxsize=1)
def agent_prompt() -> str:
    """The agent system prompt without its session line: instructions and tools."""
    tools = "\n".join(json.dumps(_tool_schema(*t)) for t in _TOOLS)
    return f"{_INSTRUCTIONS}\n\n# Tools\n\nYou can call these tools:\n<tools>\n{tools}\n</tools>"


def _generated_module(k: int) -> str:
    """A plausible Python module (the fallback when a stdlib file is missing)."""
    lines = [f'"""Generated module {k}: records and their validation."""', "", "import dataclasses", ""]
    for j in range(40):
        lines += ["@dataclasses.dataclass", f"class Record{k}_{j}:",
                  f'    """Row {j} of table {k}."""', "    name: str", "    size: int = 0", "",
                  "    def check(self) -> bool:", f"        return self.size >= {j} and bool(self.name)", ""]
    return "\n".join(lines)


@lru_cache(maxsize=1)
def code_files() -> tuple[tuple[str, str], ...]:
    """``(name, text)`` of the code the prompts quote, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for k, name in enumerate(STDLIB_FILES):
        try:
            text = (root / name).read_text(encoding="utf-8")
        except OSError:
            name, text = f"generated_{k}.py", _generated_module(k)
        out.append((f"lib/{name}", text))
    return tuple(out)


def code_lines(index: int) -> list[str]:
    """Every file's lines, each file framed by ``<file path=...>`` tags, the
    files rotated by ``index`` (each request starts on another file)."""
    files = code_files()
    k = index % len(files)
    lines: list[str] = []
    for name, text in files[k:] + files[:k]:
        lines.append(f'<file path="{name}">')
        lines.extend(text.splitlines())
        lines.append("</file>")
    return lines


TASK = ("Task: review the code above. List the three places most likely to hide a bug, each with "
        "its file, line and a one-sentence reason, then propose a fix for the first one.")


def long_messages(index: int, n_lines: int, *, seed: int = 0, agent: bool = True,
                  tail: int = 0) -> Messages:
    """A prompt holding the first ``n_lines`` lines of ``code_lines(index)``
    (and the first ``tail`` characters of the next one)."""
    session = f"session {seed}-{index}"
    system = f"{session}\n{agent_prompt()}" if agent else \
        f"{session}\nYou are a careful code reviewer. Answer briefly."
    lines = code_lines(index)
    body = lines[:max(0, n_lines)]
    if tail > 0 and n_lines < len(lines):
        body.append(lines[n_lines][:tail])
    # a file cut short still gets its closing tag, so every prompt is well formed
    if body and body[-1] != "</file>":
        body.append("</file>")
    user = "Here are files of the repository.\n\n" + "\n".join(body) + "\n\n" + TASK
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def calibrated_messages(count: Counter, index: int, target_tokens: int, *,
                              seed: int = 0) -> tuple[Messages, int]:
    """The longest ``long_messages(index, n)`` of at most ``target_tokens``
    templated tokens, and its length (binary search on ``n``)."""
    agent = target_tokens >= AGENT_THRESHOLD
    lines = code_lines(index)
    lo, hi, chars = 0, len(lines), 0
    for n, line in enumerate(lines):  # no token is longer than ~12 characters of code
        chars += len(line) + 1
        if chars > 12 * target_tokens:
            hi = n
            break
    best = long_messages(index, 0, seed=seed, agent=agent)
    best_n = await count(best)
    if best_n > target_tokens and agent:  # the agent prompt alone is too long: the short one
        agent = False
        best = long_messages(index, 0, seed=seed, agent=False)
        best_n = await count(best)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        msgs = long_messages(index, mid, seed=seed, agent=agent)
        n = await count(msgs)
        if n <= target_tokens:
            lo, best, best_n = mid, msgs, n
        else:
            hi = mid - 1
    # then as much of the next line as fits
    if lo < len(lines):
        a, b = 0, len(lines[lo])
        while a < b:
            mid = (a + b + 1) // 2
            msgs = long_messages(index, lo, seed=seed, agent=agent, tail=mid)
            n = await count(msgs)
            if n <= target_tokens:
                a, best, best_n = mid, msgs, n
            else:
                b = mid - 1
    return best, best_n


def digest(messages: Messages) -> str:
    """A short digest of a prompt (the report's proof that every target got the same text)."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
