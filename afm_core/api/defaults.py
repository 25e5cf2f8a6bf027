"""A model's own sampling defaults, filled into a request where the client left
the field out (sans-IO: a body in, a body out).

An Ollama model carries them in its ``params`` layer (``ollama show
--parameters``: ``temperature``, ``top_k``, ``stop`` strings, ...), written by
whoever packaged it; Ollama applies them under every request's own options,
and so does afm, on every API that has the field: a request's value always
wins, a default only fills a gap.  The names are Ollama's option names.

Not applied: ``num_ctx`` (afm sizes the context from the model and the
engine's limits, not per request) and the options afm's sampler does not
have (``mirostat``, ``typical_p``, ``repeat_last_n``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["API_FIELDS", "Kind", "model_defaults", "with_model_defaults"]

Kind = Literal["chat", "completions", "responses", "anthropic", "ollama"]

_NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
            "repeat_penalty": (0.01, 10.0), "presence_penalty": (-2.0, 2.0),
            "frequency_penalty": (-2.0, 2.0)}
_INTEGERS = {"top_k": (0, 1_000_000), "seed": (0, 2**63 - 1), "num_predict": (1, 2**31 - 1)}
_MAX_STOPS = 4  # the fewest any API takes (OpenAI's)

_OPENAI = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
           "num_predict": "max_tokens"}
API_FIELDS: dict[Kind, dict[str, str]] = {
    "chat": _OPENAI,
    "completions": _OPENAI,
    "responses": {"temperature": "temperature", "top_p": "top_p", "num_predict": "max_output_tokens"},
    "anthropic": {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "stop": "stop_sequences"},  # (max_tokens is required there)
    "ollama": {key: key for key in (*_NUMBERS, *_INTEGERS, "stop")},  # inside "options"
}
"""Where each default goes in each API's body (the Ollama APIs: in ``options``)."""

_SAME_AS = {"max_tokens": ("max_completion_tokens",)}
"""Fields a request may give under another name (then the default is not used)."""


def model_defaults(params: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults afm applies from an Ollama ``params`` layer: the known options
    with values in range (others are left out: a layer is the packager's, not the
    client's, so a bad value is no request error); ``stop`` as a list of strings."""
    out: dict[str, Any] = {}
    for key, (low, high) in _NUMBERS.items():
        v = params.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and low <= v <= high:
            out[key] = float(v)
    for key, (low, high) in _INTEGERS.items():
        v = params.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and low <= v <= high:
            out[key] = v
    stop = params.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    stops = [s for s in stops if isinstance(s, str) and s]
    if stops:
        out["stop"] = stops[:_MAX_STOPS]
    return out


def with_model_defaults(kind: Kind, body: Any, defaults: Mapping[str, Any]) -> Any:
    """``body`` with ``defaults`` (from :func:`model_defaults`) in the fields it
    leaves out (absent or null); a new dict when anything is added, else ``body``
    itself (a body that is no JSON object is left to the API's own error)."""
    if not defaults or not isinstance(body, dict):
        return body
    fields = API_FIELDS[kind]
    if kind == "ollama":
        options = body.get("options")
        if options is not None and not isinstance(options, dict):
            return body
        merged = dict(options or {})
        for key, value in defaults.items():
            if key in fields and merged.get(key) is None:
                merged[key] = list(value) if isinstance(value, tuple) else value
        return {**body, "options": merged} if merged != (options or {}) else body
    added = {}
    for key, value in defaults.items():
        name = fields.get(key)
        if name is None or body.get(name) is not None \
                or any(body.get(other) is not None for other in _SAME_AS.get(name, ())):
            continue
        if kind == "anthropic" and key == "temperature":
            value = min(value, 1.0)  # (Anthropic's range is 0 to 1)
        added[name] = list(value) if isinstance(value, tuple) else value
    return {**body, **added} if added else body
