"""``afm bench --real-model``: afm against llama.cpp on real models, in one run.

For each model of ``--models`` (``_real_models``: the default model, the real
GGUFs of issue 28, any GGUF file), one after another: every target up at
once (``_real_targets``: by default ``afm serve``, ``afm serve`` on its AVX2
kernels, and llama.cpp's own batching server on the same GGUF, same thread
count), then interleaved rounds, the targets' order reversed every other
round, each round on fresh prompts, through the phases of ``_real_phases``
(single-stream decode, 8 streams, time to first token at 512, 4k and 16k
prompt tokens).  After every level each server's peak RSS (``VmHWM``) is
read; at the end what each target computed with (the kernels' ISA, BLAS,
threads).  The report (``_real_report``) sets every figure against
llama.cpp's from the same run.

Prompt caches are off on every target and every long prompt starts with a
line of its own (``_prompts``), so a time to first token is a full prefill.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio

from ._errors import ServerStartError
from ._llamacpp import LLAMACPP
from ._load import competing_load
from ._real_models import ModelSpec, resolve_specs
from ._real_phases import Phase, make_counter, make_long_phase, plan_phases, short_phases
from ._real_report import build_model_report
from ._real_targets import (
    DEFAULT_REAL_TARGETS,
    REAL_TARGETS,
    SERIAL_KEYS,
    TARGET_NAMES,
    Opened,
    TargetContext,
    open_target,
    probe_info,
    unavailable,
)
from ._results import RunResult

__all__ = ["DEFAULT_REAL_TARGETS", "REAL_TARGETS", "RealConfig", "run_real"]


@dataclass(slots=True)
class RealConfig:
    """Everything that defines a real-model run; stored verbatim in the report."""

    out_dir: str
    models: tuple[str, ...] = ("default",)
    model_dir: str | None = None
    gguf: tuple[str, ...] = ()
    gguf_dir: tuple[str, ...] = ()
    targets: tuple[str, ...] = DEFAULT_REAL_TARGETS
    rounds: int = 2
    decode_tokens: int = 128
    decode_requests: int = 2
    batch_concurrency: int = 8
    batch_requests: int = 8
    batch_tokens: int = 64
    ttft_lengths: tuple[int, ...] = (512, 4096, 16384)
    ttft_requests: int = 1
    ttft_max_tokens: int = 8
    short_prompt_words: tuple[int, int] = (16, 32)
    seed: int = 0
    warmup: int = 1  # unrecorded requests per warmed phase per target
    request_timeout: float | None = None  # None: from the phase's work (see _timeouts)
    time_budget: float | None = None  # None: four times the estimate, at least 40 min
    startup_timeout: float = 600.0
    threads: int | None = None  # None: afm's default, the physical cores
    competing_load: int = 0  # processes spinning on the CPU during the phases (_load)
    afm_isa: str = "avx2"
    serve_args: tuple[str, ...] = ()
    peer_args: tuple[str, ...] = ()
    llamacpp_py_args: tuple[str, ...] = ()
    llamacpp_settings: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


def _log(msg: str) -> None:
    print(f"[afm bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Stopper:
    """Ends a run early and keeps what ran: at its deadline (the time budget,
    ``trio.current_time``'s clock) or on SIGINT/SIGTERM (a second SIGINT
    interrupts at once).  ``scope()`` is the cancel scope of one model's part."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.reason: str | None = None
        self._scope: trio.CancelScope | None = None

    def scope(self) -> trio.CancelScope:
        self._scope = trio.CancelScope(deadline=self.deadline)
        if self.reason is not None:
            self._scope.cancel()
        return self._scope

    def stop(self, reason: str) -> None:
        self.reason = reason
        if self._scope is not None:
            self._scope.cancel()

    @property
    def over(self) -> bool:
        return self.reason is not None or trio.current_time() >= self.deadline

    async def watch_signals(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            receiver = trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)
        except RuntimeError:  # not the main thread: no signals to watch
            task_status.started()
            return
        with receiver as signals:
            task_status.started()
            async for sig in signals:
                self.stop(f"stopped by {signal.Signals(sig).name}")
                _log(f"{self.reason}: stopping the servers and writing the report of what ran")
                return


def rough_speeds(spec: ModelSpec) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) to expect on a 2-core machine, from the
    bytes a forward pass reads (for the duration estimate only)."""
    wb = spec.weight_bytes or 100e6
    return min(60.0, 8e9 / wb), min(300.0, 30e9 / wb)


def expected_seconds(cfg: RealConfig, spec: ModelSpec, plans: list[Any], n_targets: int) -> float:
    """A rough duration of one model's part of the run."""
    dec, pre = rough_speeds(spec)
    per_round = 0.0
    warm = 0.0
    for p in plans:
        prompt = p.prompt_tokens or 60
        one = prompt / pre + p.max_tokens / dec
        per_round += p.requests * one / (1 if p.kind != "batch" else p.concurrency / 3)
        warm += one if p.warm else 0.0
    return n_targets * (60.0 + cfg.warmup * warm + cfg.rounds * per_round)


def _timeouts(cfg: RealConfig, spec: ModelSpec, phase: Phase) -> tuple[float, float]:
    """(request, level) time limits: generous bounds (a sixtieth of the
    rough speeds: a 2-core machine under a load of 10 ran 10-50 times slower),
    only there so that a stuck target cannot hang the run."""
    dec, pre = rough_speeds(spec)
    p = phase.plan
    prompt = max(phase.prompt_tokens or [60])
    request = cfg.request_timeout or max(600.0, 60 * (prompt / pre + p.max_tokens / dec))
    waves = math.ceil(p.requests / p.concurrency)
    return request, request * waves + 60.0


def select_targets(cfg: RealConfig, spec: ModelSpec, ctx: TargetContext) -> \
        tuple[list[str], dict[str, str]]:
    """The targets that can run on ``spec`` here, and why the others cannot."""
    skipped: dict[str, str] = {}
    names = []
    for key in REAL_TARGETS:
        if key not in cfg.targets:
            continue
        why = unavailable(key, spec, ctx)
        if why is None:
            names.append(key)
        else:
            skipped[TARGET_NAMES[key]] = why
            _log(f"{spec.name}: skipping {TARGET_NAMES[key]}: {why}")
    return names, skipped


def _n_ctx(cfg: RealConfig, spec: ModelSpec, plans: list[Any]) -> int:
    longest = max([p.prompt_tokens or 0 for p in plans] + [0])
    short = cfg.batch_concurrency * (2 * cfg.short_prompt_words[1] + 120 + cfg.batch_tokens)
    need = max(longest + max(cfg.ttft_max_tokens, cfg.decode_tokens) + 64, short, 512)
    need = -(-need // 256) * 256
    return min(need, spec.context) if spec.context else need


async def _open_all(cfg: RealConfig, spec: ModelSpec, ctx: TargetContext, keys: list[str],
                    stack: AsyncExitStack, skipped: dict[str, str]) -> list[Opened]:
    opened = []
    for key in keys:
        try:
            opened.append(await open_target(key, spec, ctx, stack, log=_log))
        except ServerStartError as exc:
            skipped[TARGET_NAMES[key]] = f"failed to start: {str(exc)[:500]}"
            _log(f"{spec.name}: {skipped[TARGET_NAMES[key]]}")
    return opened


async def _make_phases(cfg: RealConfig, spec: ModelSpec, plans: list[Any],
                       opened: list[Opened]) -> tuple[list[Phase], str]:
    llama_url = next((o.base_url for o in opened if o.key == "llamacpp"), None)
    count, source = make_counter(spec, llama_url)
    phases = short_phases(cfg, plans)
    for p in plans:
        if p.kind == "ttft":
            phases.append(await make_long_phase(cfg, p, count))
    for ph in phases:
        mean = ph.describe()["prompt_tokens_mean"]
        _log(f"{spec.name}: phase {ph.name}: {ph.title}"
             + (f"; prompts {mean:.0f} tokens on average ({source})" if mean is not None else ""))
    return phases, source


async def run_model(cfg: RealConfig, spec: ModelSpec, log_dir: Path, stopper: Stopper) -> dict[str, Any]:
    """One model's part of the run (``stopper`` may end it early, keeping
    what ran): its report section."""
    from afm_core._mlx.blas import physical_cores

    plans = plan_phases(cfg, spec.context)
    threads = cfg.threads or physical_cores()
    ctx = TargetContext(log_dir=log_dir, threads=threads, threads_explicit=cfg.threads is not None,
                        max_batch=cfg.batch_concurrency, n_ctx=_n_ctx(cfg, spec, plans),
                        afm_isa=cfg.afm_isa, startup_timeout=cfg.startup_timeout,
                        serve_args=cfg.serve_args, peer_args=cfg.peer_args,
                        llamacpp_py_args=cfg.llamacpp_py_args,
                        llamacpp_settings=cfg.llamacpp_settings)
    keys, skipped = select_targets(cfg, spec, ctx)
    est = expected_seconds(cfg, spec, plans, len(keys))
    _log(f"{spec.name}: targets {', '.join(TARGET_NAMES[k] for k in keys) or 'none'}, "
         f"{cfg.rounds} rounds, {threads} threads, llama.cpp n_ctx {ctx.n_ctx}; "
         f"expected about {est / 60:.0f} min on a 2-core machine")
    runs: list[RunResult] = []
    servers: dict[str, dict[str, Any]] = {}
    phases: list[Phase] = []
    sequence: list[list[Any]] = []
    source = ""
    t0 = time.perf_counter()
    load_start = list(os.getloadavg())
    async with AsyncExitStack() as stack:
        opened = await _open_all(cfg, spec, ctx, keys, stack, skipped)
        for o in opened:
            servers[o.name] = dict(o.info)
        with stopper.scope() as scope:
            if opened:
                phases, source = await _make_phases(cfg, spec, plans, opened)
                async with competing_load(cfg.competing_load):
                    await _rounds(cfg, spec, opened, phases, runs, servers, sequence)
        if scope.cancelled_caught:
            skipped["stopped"] = stopper.reason or "the run's time budget ran out during this model"
        if opened:
            _sample_rss(opened, servers)
            for o in opened:
                servers[o.name].update(await probe_info(o, threads))
    return build_model_report(runs, spec=spec.describe(), phases=[ph.describe() for ph in phases],
                              servers=servers, skipped=skipped,
                              extra={"prompt_counter": source, "threads": threads,
                                     "competing_load": cfg.competing_load,
                                     "sequence": sequence,
                                     "llamacpp_n_ctx": ctx.n_ctx, "expected_s": est,
                                     "elapsed_s": time.perf_counter() - t0,
                                     "loadavg_start": load_start,
                                     "loadavg_end": list(os.getloadavg())})


def _sample_rss(opened: list[Opened], servers: dict[str, dict[str, Any]]) -> None:
    from ._servers import peak_rss_bytes

    for o in opened:
        rss = peak_rss_bytes(o.pid)
        if rss is not None:
            entry = servers.setdefault(o.name, {})
            entry["peak_rss_bytes"] = max(rss["peak"], entry.get("peak_rss_bytes", 0))
            entry["rss_bytes"] = rss.get("current")


def _runs_on(o: Opened, ph: Phase) -> bool:
    return not (o.key in SERIAL_KEYS and ph.plan.concurrency > 1)


async def _rounds(cfg: RealConfig, spec: ModelSpec, opened: list[Opened], phases: list[Phase],
                  runs: list[RunResult], servers: dict[str, dict[str, Any]],
                  sequence: list[list[Any]]) -> None:
    """Warm-up, then the interleaved rounds (order reversed every other round);
    ``sequence`` gets ``[round, phase, target]`` of every level as it ran."""
    _sample_rss(opened, servers)
    for o in opened:
        if cfg.warmup <= 0:
            break
        _log(f"{spec.name}: warming up {o.name}")
        for ph in phases:
            if ph.plan.warm and _runs_on(o, ph):
                req, level = _timeouts(cfg, spec, ph)
                await o.drive(ph.workload, ph.plan.concurrency, ph.first_index(cfg.rounds),
                              cfg.warmup, level, req)
    for r in range(cfg.rounds):
        order = opened if r % 2 == 0 else opened[::-1]
        for ph in phases:
            req, level = _timeouts(cfg, spec, ph)
            for o in order:
                if not _runs_on(o, ph):
                    continue
                run = await o.drive(ph.workload, ph.plan.concurrency, ph.first_index(r),
                                    ph.plan.requests, level, req)
                run.mode, run.round = ph.name, r
                runs.append(run)
                sequence.append([r, ph.name, o.name])
                _sample_rss(opened, servers)
                s = run.summary()
                tpot = s["tpot_ms"]["p50"]
                _log(f"{spec.name}: round {r + 1}/{cfg.rounds} {ph.name} {o.name}: "
                     f"{s['ok']}/{s['requests']} ok, {s['output_tokens_per_s'] or 0:.1f} tok/s, "
                     f"decode {1000 / tpot if tpot else 0:.1f} tok/s, "
                     f"TTFT p50 {s['ttft_ms']['p50'] or 0:.0f} ms, errors {s['error_count']}")


def run_meta(out_dir: str) -> dict[str, Any]:
    """The machine, versions and load of a real-model or speculation run."""
    from importlib.metadata import PackageNotFoundError, version

    from ._run import BenchConfig
    from ._run import _meta as bench_meta

    meta = bench_meta(BenchConfig(model="(see models)", out_dir=out_dir))
    for pkg in ("xllamacpp", "llama-cpp-python"):
        try:
            meta["versions"][pkg] = version(pkg)
        except PackageNotFoundError:
            meta["versions"][pkg] = None
    # every target inherits these (a machine-wide OPENBLAS_CORETYPE changes afm's BLAS too)
    meta["env"] = {k: v for k, v in sorted(os.environ.items())
                   if k.startswith(("AFM_", "OPENBLAS_", "OMP_", "GOMP_", "GGML_", "LLAMA_"))}
    return meta


async def run_real(cfg: RealConfig) -> dict[str, Any]:
    """Run the real-model comparison and return its report dict."""
    if cfg.rounds < 1:
        raise ValueError("rounds must be >= 1")
    meta = run_meta(cfg.out_dir)
    specs, missing = await trio.to_thread.run_sync(lambda: resolve_specs(
        cfg.models, model_dir=cfg.model_dir, gguf=cfg.gguf, gguf_dir=cfg.gguf_dir))
    for name, why in missing.items():
        _log(f"model {name}: {why}")
    budget = cfg.time_budget or max(2400.0, 4 * sum(
        expected_seconds(cfg, s, plan_phases(cfg, s.context), len(cfg.targets)) for s in specs))
    t0 = time.perf_counter()
    stopper = Stopper(trio.current_time() + budget)
    models: list[dict[str, Any]] = []
    log_dir = Path(cfg.out_dir) / "logs"
    async with trio.open_nursery() as nursery:
        await nursery.start(stopper.watch_signals)
        for spec in specs:
            if stopper.over:
                missing[spec.name] = stopper.reason or f"the time budget of {budget:g} s ran out before it"
                continue
            models.append(await run_model(cfg, spec, log_dir, stopper))
        nursery.cancel_scope.cancel()
    meta["elapsed_s"] = time.perf_counter() - t0
    meta["time_budget_s"] = budget
    meta["loadavg_end"] = list(os.getloadavg())
    report = {"mode": "real-model", "baseline": LLAMACPP, "meta": meta, "config": asdict(cfg),
              "models": models, "missing": missing}
    json.dumps(report, default=str)  # fail here, not in write_report, on a bad value
    return report
