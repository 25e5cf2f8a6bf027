"""Prometheus text exposition (format 0.0.4) of the engines' statistics.

Each loaded model's engine counters are labelled by model (they start at zero
again when a model is loaded again); the served models' load state, loads,
unloads and load seconds (:class:`afm_http._residency.Residency` rows) are
labelled the same way, whether the model is loaded or not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from afm_core import EngineStatistics

from ._residency import Residency

__all__ = ["CONTENT_TYPE", "escape_label", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, kind, help, EngineStatistics attribute): declared once, by the fields' metadata
_SIMPLE = tuple((m.name, m.kind, m.help, attr) for attr, m in EngineStatistics.metrics())


def escape_label(value: str) -> str:
    """``value`` escaped for a label value (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _header(lines: list[str], name: str, kind: str, help_text: str) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")


def render(engines: Sequence[tuple[Any, str]], http: Mapping[int, int], *, draining: bool = False,
           inflight: int = 0, models: Sequence[Residency] = (),
           max_loaded_bytes: int | None = None) -> str:
    """The exposition text for each engine's ``(EngineStatistics, model id)`` (the
    loaded models, then a ``--embedding-model``: one line each, labelled by model),
    HTTP status counts, whether the server is draining, the requests its HTTP
    layer holds open, and each served model's residency (``models``)."""
    labelled = [(stats, f'model="{escape_label(model)}"') for stats, model in engines]
    lines: list[str] = []
    for name, kind, help_text, attr in _SIMPLE:
        _header(lines, name, kind, help_text)
        lines.extend(f"{name}{{{label}}} {getattr(stats, attr)}" for stats, label in labelled)
    _header(lines, "afm_draining", "gauge", "1 while the server drains (not ready, new requests refused).")
    lines.append(f"afm_draining {int(draining)}")
    _header(lines, "afm_http_requests_inflight", "gauge",
            "Request ids the HTTP layer holds open with the engine.")
    lines.append(f"afm_http_requests_inflight {inflight}")
    _header(lines, "afm_time_to_first_token_seconds", "summary", "Submission to first event.")
    for stats, label in labelled:
        lines.append(f"afm_time_to_first_token_seconds_sum{{{label}}} {stats.ttft_seconds_sum:.6f}")
        lines.append(f"afm_time_to_first_token_seconds_count{{{label}}} {stats.ttft_count}")
    _header(lines, "afm_requests_finished_total", "counter", "Finished streams by finish reason.")
    for stats, label in labelled:
        for reason, n in sorted(stats.finished.items()):
            lines.append(f'afm_requests_finished_total{{{label},reason="{escape_label(reason)}"}} {n}')
    _header(lines, "afm_http_responses_total", "counter", "HTTP responses by status code.")
    for status, n in sorted(http.items()):
        lines.append(f'afm_http_responses_total{{status="{int(status)}"}} {n}')
    if models:
        _models(lines, models, max_loaded_bytes)
    return "\n".join(lines) + "\n"


_STATES = ("unloaded", "loading", "loaded", "unloading")


def _models(lines: list[str], rows: Sequence[Residency], max_loaded_bytes: int | None) -> None:
    labelled = [(row, f'model="{escape_label(row.id)}"') for row in rows]
    _header(lines, "afm_model_state", "gauge", "1 for the state each served model is in.")
    for row, label in labelled:
        lines.extend(f'afm_model_state{{{label},state="{s}"}} {int(row.state == s)}' for s in _STATES)
    _header(lines, "afm_model_requests_inflight", "gauge",
            "Requests holding a model (waiting for its load, or answered by it).")
    lines.extend(f"afm_model_requests_inflight{{{label}}} {row.inflight}" for row, label in labelled)
    _header(lines, "afm_model_weight_bytes", "gauge",
            "A model's weights on disk (what --max-loaded-bytes counts).")
    lines.extend(f"afm_model_weight_bytes{{{label}}} {row.size}" for row, label in labelled)
    _header(lines, "afm_model_loads_total", "counter", "Loads of a model that succeeded.")
    lines.extend(f"afm_model_loads_total{{{label}}} {row.loads}" for row, label in labelled)
    _header(lines, "afm_model_load_failures_total", "counter", "Loads of a model that failed.")
    lines.extend(f"afm_model_load_failures_total{{{label}}} {row.load_failures}" for row, label in labelled)
    _header(lines, "afm_model_load_seconds", "summary", "Seconds from a load's start to its model serving.")
    for row, label in labelled:
        lines.append(f"afm_model_load_seconds_sum{{{label}}} {row.load_seconds:.6f}")
        lines.append(f"afm_model_load_seconds_count{{{label}}} {row.loads}")
    _header(lines, "afm_model_unloads_total", "counter",
            "Unloads of a model by reason (idle: its keep-alive ran out; evicted: room for another).")
    for row, label in labelled:
        for reason in ("idle", "evicted"):
            lines.append(f'afm_model_unloads_total{{{label},reason="{reason}"}} {row.unloads[reason]}')
    _header(lines, "afm_models_loaded_bytes", "gauge",
            "Weights bytes of the models loading, loaded or unloading.")
    lines.append(f"afm_models_loaded_bytes {sum(r.size for r in rows if r.state != 'unloaded')}")
    if max_loaded_bytes is not None:
        _header(lines, "afm_models_max_loaded_bytes", "gauge", "The --max-loaded-bytes budget.")
        lines.append(f"afm_models_max_loaded_bytes {max_loaded_bytes}")
