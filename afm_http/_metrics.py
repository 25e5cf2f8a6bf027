"""Prometheus text exposition of the engine's statistics."""

from __future__ import annotations

from typing import Any


def render(stats: Any, model: str, http: dict[str, int]) -> str:
    label = f'model="{model}"'
    lines = []

    def metric(name: str, kind: str, help_text: str, value: float, labels: str = label) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{{{labels}}} {value}")

    metric("afm_requests_running", "gauge", "Streams in the decode batch.", stats.running)
    metric("afm_requests_waiting", "gauge", "Admitted requests not yet decoding.", stats.waiting)
    metric("afm_requests_total", "counter", "Requests submitted to the engine.", stats.requests_total)
    metric("afm_prompt_tokens_total", "counter", "Prompt tokens submitted.", stats.prompt_tokens)
    metric("afm_generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens)
    metric("afm_prefix_cache_hits_total", "counter", "Requests that reused a cached prefix.",
           stats.prefix_cache_hits)
    metric("afm_prefix_cache_lookups_total", "counter", "Prefix cache lookups.", stats.prefix_cache_lookups)
    metric("afm_cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
           stats.cached_tokens)
    metric("afm_prefix_cache_bytes", "gauge", "Bytes held by the prefix cache.", stats.prefix_cache_bytes)
    metric("afm_engine_steps_total", "counter", "Engine steps run.", stats.steps)
    lines.append("# HELP afm_time_to_first_token_seconds Submission to first event.")
    lines.append("# TYPE afm_time_to_first_token_seconds summary")
    lines.append(f"afm_time_to_first_token_seconds_sum{{{label}}} {stats.ttft_seconds_sum:.6f}")
    lines.append(f"afm_time_to_first_token_seconds_count{{{label}}} {stats.ttft_count}")
    lines.append("# HELP afm_requests_finished_total Finished streams by finish reason.")
    lines.append("# TYPE afm_requests_finished_total counter")
    for reason, n in sorted(stats.finished.items()):
        lines.append(f'afm_requests_finished_total{{{label},reason="{reason}"}} {n}')
    lines.append("# HELP afm_http_responses_total HTTP responses by status code.")
    lines.append("# TYPE afm_http_responses_total counter")
    for status, n in sorted(http.items()):
        lines.append(f'afm_http_responses_total{{status="{status}"}} {n}')
    return "\n".join(lines) + "\n"
