"""Per-request profiles for ``X-AFM-Profile`` (recorded on the MLX thread).

Fields of ``afm_profile``: :data:`FIELDS` (each with its unit and source;
every one measured or derived, never invented).

GPU power fields are omitted: no platform we run on exposes them to us.

``afm_profile_extended`` is ``{"summary": <the fields above>, "samples": [...]}``
with one sample per ``sample_interval`` seconds: ``t`` (s since submission),
``phase`` (prefill/decode), ``tokens`` (completion tokens so far),
``decode_tok_s`` (rate since the previous sample), ``batch_size`` and
``memory_active_gib``.
"""

from __future__ import annotations

import platform
import time
from functools import cache
from typing import Any

GIB = float(1 << 30)

FIELDS: dict[str, tuple[str, str]] = {
    "prefill_tok_s": ("tok/s", "prompt tokens actually computed (cache misses) / time from admission "
                               "to the first token"),
    "decode_tok_s": ("tok/s", "(completion tokens - 1) / time from first to last token"),
    "ttft_s": ("s", "submission to first generated token"),
    "queue_s": ("s", "submission to admission by the generation thread (template, tokenization, "
                     "waiting for the step in progress); ttft_s - queue_s is prefill and the first "
                     "decode step"),
    "prompt_tokens": ("tokens", "as in usage"),
    "cached_tokens": ("tokens", "as in usage"),
    "prefix_tier": ("text", "which tier of the prefix cache served the cached_tokens: memory, disk "
                            "(read back from cache_dir), or null (none)"),
    "completion_tokens": ("tokens", "as in usage"),
    "memory_weights_gib": ("GiB", "bytes of the model's parameters"),
    "memory_kv_gib": ("GiB", "bytes of this request's KV cache at the end (estimated from the "
                             "model's config and kv_bits)"),
    "kv_bits": ("bits", "bits per element of the KV cache (EngineConfig.kv_bits: 8 or 4, "
                        "quantized), or null: float"),
    "memory_active_gib": ("GiB", "mx.get_active_memory() at the end"),
    "memory_peak_gib": ("GiB", "mx.get_peak_memory() (process peak)"),
    "chip": ("text", "Apple chip name, else the CPU model from /proc/cpuinfo (or "
                     "platform.processor())"),
    "device": ("text", "MLX default device (cpu / gpu)"),
    "blas": ("text", "the BLAS computing MLX's CPU products (afm_core._mlx.blas: openblas, "
                     "reference, accelerate); when known"),
    "spec_proposed": ("tokens", "speculative decoding (prompt_lookup or draft_model): tokens "
                                "proposed for this request; only when the engine speculates"),
    "spec_accepted": ("tokens", "of those, the tokens the model accepted"),
    "batch_size_mean": ("seqs", "mean decode batch size while the request ran"),
    "est_bandwidth_gbs": ("GB/s", "(weights + this KV) bytes read per decode step x decode steps "
                                  "per second; an estimate"),
    "theoretical_bw_gbs": ("GB/s", "only for known Apple chips; omitted elsewhere"),
}
"""The fields of ``afm_profile`` (the summary), in the order sent: ``name: (unit,
where it comes from)``; :meth:`ProfileRecorder.payload` sends no other."""

# Apple unified-memory bandwidths (GB/s) from Apple's published specs.
_APPLE_BW = {
    "Apple M1": 68.25, "Apple M1 Pro": 200.0, "Apple M1 Max": 400.0, "Apple M1 Ultra": 800.0,
    "Apple M2": 100.0, "Apple M2 Pro": 200.0, "Apple M2 Max": 400.0, "Apple M2 Ultra": 800.0,
    "Apple M3": 100.0, "Apple M3 Pro": 150.0, "Apple M3 Max": 400.0, "Apple M3 Ultra": 819.0,
    "Apple M4": 120.0, "Apple M4 Pro": 273.0, "Apple M4 Max": 546.0,
}


@cache
def chip_name() -> str:
    if platform.system() == "Darwin":
        try:
            import subprocess

            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=2
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, ValueError):
            pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _r(x: float, nd: int = 3) -> float:
    return round(x, nd)


class ProfileRecorder:
    """Collects one request's timings; ``payload()`` builds the profile object."""

    def __init__(self, *, extended: bool, t_submit: float, sample_interval: float = 0.1):
        self.extended = extended
        self.t_submit = t_submit
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.sample_interval = sample_interval
        self.samples: list[dict[str, Any]] = []
        self._next_sample = 0.0
        self._last_tokens = 0
        self._last_t = t_submit
        self._batch_sum = 0
        self._batch_steps = 0
        self.prefix_tier: str | None = None
        """Set by the generation thread when the prefix cache serves the prompt."""
        self.spec: tuple[int, int] | None = None
        """(proposed, accepted) speculative tokens, set by the generation thread
        when the engine speculates."""

    def admitted(self, now: float) -> None:
        self.t_admit = now

    def step(self, now: float, tokens: int, batch_size: int, active_bytes: int) -> None:
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self._batch_sum += batch_size
        self._batch_steps += 1
        if self.extended and now - self.t_submit >= self._next_sample:
            dt = now - self._last_t
            rate = (tokens - self._last_tokens) / dt if dt > 0 else 0.0
            self.samples.append(
                {
                    "t": _r(now - self.t_submit, 4),
                    "phase": "decode" if tokens > 1 else "prefill",
                    "tokens": tokens,
                    "decode_tok_s": _r(rate, 2),
                    "batch_size": batch_size,
                    "memory_active_gib": _r(active_bytes / GIB, 4),
                }
            )
            self._last_t, self._last_tokens = now, tokens
            self._next_sample = now - self.t_submit + self.sample_interval

    def payload(
        self,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        weights_bytes: int,
        kv_bytes: int,
        active_bytes: int,
        peak_bytes: int,
        device: str,
        blas: str = "",
        kv_bits: int | None = None,
    ) -> dict[str, Any]:
        now = time.perf_counter()
        t_first = self.t_first or now
        t_admit = self.t_admit or self.t_submit
        computed = max(prompt_tokens - cached_tokens, 0)
        prefill_s = max(t_first - t_admit, 1e-9)
        decode_s = (self.t_last or t_first) - t_first
        decode_rate = (completion_tokens - 1) / decode_s if completion_tokens > 1 and decode_s > 0 else 0.0
        chip = chip_name()
        summary: dict[str, Any] = {
            "prefill_tok_s": _r(computed / prefill_s, 2),
            "decode_tok_s": _r(decode_rate, 2),
            "ttft_s": _r(t_first - self.t_submit, 4),
            "queue_s": _r(t_admit - self.t_submit, 4),
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "prefix_tier": self.prefix_tier if cached_tokens else None,
            "completion_tokens": completion_tokens,
            "memory_weights_gib": _r(weights_bytes / GIB, 4),
            "memory_kv_gib": _r(kv_bytes / GIB, 6),
            "kv_bits": kv_bits,
            "memory_active_gib": _r(active_bytes / GIB, 4),
            "memory_peak_gib": _r(peak_bytes / GIB, 4),
            "chip": chip,
            "device": device,
        }
        if blas:
            summary["blas"] = blas
        if self.spec is not None:
            summary["spec_proposed"], summary["spec_accepted"] = self.spec
        steps = self._batch_steps
        if steps:
            summary["batch_size_mean"] = _r(self._batch_sum / steps, 2)
        if decode_rate > 0 and steps:
            # every decode step streams the weights once (shared by the batch) and
            # this request's KV; decode steps/s = the request's token rate
            summary["est_bandwidth_gbs"] = _r((weights_bytes + kv_bytes) * decode_rate / 1e9, 3)
        bw = _APPLE_BW.get(chip)
        if bw is not None:
            summary["theoretical_bw_gbs"] = bw
        summary = {name: summary[name] for name in FIELDS if name in summary}  # (FIELDS' order)
        if not self.extended:
            return summary
        return {"summary": summary, "samples": self.samples}
