"""Run llama.cpp's own server loop (``xllamacpp.Server``) as a benchmark peer.

Run as a script, never imported by afm (so the process holds llama.cpp and
nothing of afm or MLX, and its peak RSS is llama.cpp's own)::

    python _llamacpp_launcher.py --model FILE.gguf --port P [--set KEY=VALUE ...]

``xllamacpp`` (PyPI, a prebuilt llama.cpp) wraps the C++ ``server_context``
of ``llama-server``: continuous batching over ``n_parallel`` slots, the
OpenAI-compatible HTTP endpoints (``/v1/chat/completions``, ``/health``,
``/tokenize``, ``/apply-template``).  Each ``--set`` assigns one attribute of
its ``CommonParams`` by dotted path (``n_parallel=8``,
``cpuparams.n_threads=2``, ``speculative.draft.n_max=4``); values are JSON
(``true``, ``8``, ``"text"``) or else taken as text.  A few names are
enumerations and are written by member name (``flash_attn_type=DISABLED``,
``speculative.types=NGRAM_SIMPLE``, a comma list for several).

The launcher prints one line ``afm-bench-llamacpp: {json}`` (version, the
CPU features ggml was built for, the settings) once the server listens, then
waits for SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

MARK = "afm-bench-llamacpp:"

#: attribute name -> the xllamacpp enumeration its value is a member of
_ENUMS = {
    "flash_attn_type": ("llama_flash_attn_type", "LLAMA_FLASH_ATTN_TYPE_"),
    "cache_type_k": ("ggml_type", "GGML_TYPE_"),
    "cache_type_v": ("ggml_type", "GGML_TYPE_"),
    "types": ("common_speculative_type", "COMMON_SPECULATIVE_TYPE_"),
    "reasoning_format": ("common_reasoning_format", "COMMON_REASONING_FORMAT_"),
}


def parse_value(text: str) -> Any:
    """A ``--set`` value: JSON when it parses, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _enum_value(xlc: Any, leaf: str, value: Any) -> Any:
    kind = _ENUMS.get(leaf)
    if kind is None or not isinstance(value, str):
        return value
    enum = getattr(xlc, kind[0])
    members = [getattr(enum, kind[1] + name.strip().upper()) for name in value.split(",")]
    return members if leaf == "types" else members[0]


def apply_setting(xlc: Any, params: Any, key: str, value: Any) -> None:
    """``params.<key> = value`` along a dotted path (enumerations by name)."""
    *path, leaf = key.split(".")
    obj = params
    for part in path:
        obj = getattr(obj, part)
    if not hasattr(obj, leaf):
        raise SystemExit(f"xllamacpp's CommonParams has no setting {key!r}")
    setattr(obj, leaf, _enum_value(xlc, leaf, value))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    settings: dict[str, Any] = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes KEY=VALUE, not {item!r}")
        settings[key] = parse_value(raw)
        apply_setting(xlc, params, key, settings[key])
    server = xlc.Server(params)
    info = {"version": getattr(xlc, "__version__", None), "system_info": xlc.get_system_info(),
            "listening": server.listening_address, "settings": settings}
    print(MARK, json.dumps(info), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    del server  # stops the server loop and its HTTP threads
    return 0


if __name__ == "__main__":
    sys.exit(main())
