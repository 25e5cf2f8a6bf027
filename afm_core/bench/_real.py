"""``afm bench --real-model``: the default model, afm against llama.cpp.

One run, every target up at once, interleaved rounds (the order reversed
every other round): ``raw`` (mlx-lm's ``BatchGenerator`` in this process),
``mlx_lm.server``, ``ours`` (``afm serve``) on the mlx-lm directory that
``afm serve`` loads by default, and ``llama.cpp`` (``llama_cpp.server`` from
llama-cpp-python) on the GGUF file that directory was converted from.  Three
phases per round, each on fresh prompts:

* ``decode``: one request at a time, short prompts, ``decode_tokens``;
* ``batch``: ``batch_concurrency`` (8) streams at once;
* ``ttft``: one request at a time, prompts of about ``ttft_prompt_tokens``
  (512) tokens, a few output tokens.

After every level each server's peak RSS (``VmHWM``) is read; at the end the
BLAS each target used (afm's ``/health``, the peer launcher's log line, this
process for raw, llama.cpp's system info).  The report
(``_real_report``) sets every figure against llama.cpp's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from . import _loadgen, _servers
from ._errors import ServerStartError
from ._raw import RawRunner
from ._real_report import LLAMACPP, build_real_report
from ._report import OURS, PEER, RAW, RAW_KERNELS
from ._results import RunResult
from ._workload import Workload, make_workload

REAL_TARGETS = ("raw", "raw_kernels", "peer", "ours", "llamacpp")
DEFAULT_REAL_TARGETS = ("raw", "peer", "ours", "llamacpp")
TARGET_NAMES = {"raw": RAW, "raw_kernels": RAW_KERNELS, "peer": PEER, "ours": OURS,
                "llamacpp": LLAMACPP}


@dataclass(slots=True)
class RealConfig:
    """Everything that defines a real-model run; stored verbatim in the report."""

    model: str
    gguf: str | None
    out_dir: str
    targets: tuple[str, ...] = DEFAULT_REAL_TARGETS
    rounds: int = 2
    decode_tokens: int = 128
    decode_requests: int = 2
    batch_concurrency: int = 8
    batch_requests: int = 8
    batch_tokens: int = 64
    ttft_prompt_tokens: int = 512
    ttft_requests: int = 2
    ttft_max_tokens: int = 8
    short_prompt_words: tuple[int, int] = (16, 32)
    seed: int = 0
    warmup: int = 1  # unrecorded requests per phase per target
    request_timeout: float = 300.0
    level_timeout: float = 600.0
    time_budget: float = 2400.0
    startup_timeout: float = 300.0
    llamacpp_threads: int = 2
    llamacpp_ctx: int = 2048
    serve_args: tuple[str, ...] = ()
    peer_args: tuple[str, ...] = ()
    llamacpp_args: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Phase:
    """One kind of level; round ``r`` uses jobs ``r*requests ..`` of its
    workload and the warm-up the jobs after the last round's."""

    name: str
    title: str
    concurrency: int
    requests: int
    workload: Workload

    def first_index(self, round_: int) -> int:
        return round_ * self.requests


def _log(msg: str) -> None:
    print(f"[afm bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompt_lengths(tokenizer: Any, workload: Workload) -> list[int]:
    """Each job's chat-templated prompt length in tokens."""
    return [len(tokenizer.apply_chat_template([dict(m) for m in job.messages],
                                              add_generation_prompt=True, tokenize=True))
            for job in workload.jobs]


def calibrate_words(count: Callable[[int], float], target_tokens: int) -> int:
    """Words per prompt whose mean templated length (``count(words)``) is
    closest to ``target_tokens`` (a few secant-like steps; the workload's
    words are about one token each)."""
    words = max(1, target_tokens - 40)
    best = (abs(count(words) - target_tokens), words)
    for _ in range(4):
        got = count(words)
        if abs(got - target_tokens) < best[0]:
            best = (abs(got - target_tokens), words)
        if abs(got - target_tokens) < 2:
            break
        per_word = max(0.5, (got - 30) / words)
        words = max(1, round(words + (target_tokens - got) / per_word))
    final = count(words)
    if abs(final - target_tokens) < best[0]:
        best = (abs(final - target_tokens), words)
    return best[1]


def make_phases(cfg: RealConfig, tokenizer: Any | None) -> tuple[list[Phase], dict[str, float]]:
    """The three phases' workloads (distinct seeds) and their mean prompt
    lengths in tokens (empty without a tokenizer)."""
    n = cfg.rounds

    def wl(k: int, requests: int, words: tuple[int, int], max_tokens: int) -> Workload:
        return make_workload(cfg.seed * 4 + k, requests * n + cfg.warmup,
                             prompt_words=words, max_tokens=max_tokens)

    long_words = max(1, cfg.ttft_prompt_tokens - 40)
    if tokenizer is not None:
        def count(words: int) -> float:
            lengths = prompt_lengths(tokenizer, wl(3, cfg.ttft_requests, (words, words), 1))
            return sum(lengths) / len(lengths)

        long_words = calibrate_words(count, cfg.ttft_prompt_tokens)
    phases = [
        Phase("decode", f"1 stream, {cfg.decode_tokens} tokens, short prompts "
                        f"({cfg.decode_requests} request(s) per round)",
              1, cfg.decode_requests,
              wl(1, cfg.decode_requests, cfg.short_prompt_words, cfg.decode_tokens)),
        Phase("batch", f"{cfg.batch_concurrency} streams at once, {cfg.batch_tokens} tokens each, "
                       f"short prompts ({cfg.batch_requests} request(s) per round)",
              cfg.batch_concurrency, cfg.batch_requests,
              wl(2, cfg.batch_requests, cfg.short_prompt_words, cfg.batch_tokens)),
        Phase("ttft", f"1 stream, ~{cfg.ttft_prompt_tokens}-token prompts, {cfg.ttft_max_tokens} "
                      f"tokens ({cfg.ttft_requests} request(s) per round)",
              1, cfg.ttft_requests,
              wl(3, cfg.ttft_requests, (long_words, long_words), cfg.ttft_max_tokens)),
    ]
    means: dict[str, float] = {}
    if tokenizer is not None:
        for ph in phases:
            lengths = prompt_lengths(tokenizer, ph.workload)
            means[ph.name] = sum(lengths) / len(lengths)
    return phases, means


#: Rough speeds of this mode's targets on a 2-core x86 machine (tokens/s), for
#: the duration estimate printed up front: (decode, 8-stream aggregate, prefill).
_ROUGH = {"raw": (18.0, 60.0, 250.0), "peer": (15.0, 45.0, 200.0),
          "ours": (18.0, 60.0, 250.0), "llamacpp": (60.0, 60.0, 800.0)}


def expected_seconds(cfg: RealConfig, targets: tuple[str, ...]) -> float:
    """A rough duration of the run (startups, warm-up and every round)."""
    total = 0.0
    for t in targets:
        dec, agg, pre = _ROUGH.get(t, _ROUGH["peer"])
        per_round = (cfg.decode_requests * (cfg.decode_tokens / dec + 40 / pre)
                     + cfg.batch_requests * cfg.batch_tokens / agg
                     + cfg.ttft_requests * (cfg.ttft_prompt_tokens / pre + cfg.ttft_max_tokens / dec))
        warm = cfg.warmup * (cfg.decode_tokens / dec + cfg.batch_tokens / dec
                             + cfg.ttft_prompt_tokens / pre)
        total += 30.0 + warm + cfg.rounds * per_round
    return total


def _llamacpp_system_info() -> str | None:
    """llama.cpp's ``system_info`` line (CPU features, BLAS) in a fresh process."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _llamacpp_blas(info: str | None) -> dict[str, Any]:
    if not info:
        return {"name": "ggml"}
    blas = "BLAS = 1" in info or "BLAS=1" in info.replace(" ", "")
    return {"name": "ggml+blas" if blas else "ggml (own CPU kernels)", "detail": info[:400]}


async def _health_blas(base_url: str) -> dict[str, Any] | None:
    try:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            resp = await client.get(base_url + "/health")
        value = resp.json().get("blas")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return value if isinstance(value, dict) else None


def _meta(cfg: RealConfig) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    from ._run import BenchConfig
    from ._run import _meta as bench_meta

    meta = bench_meta(BenchConfig(model=cfg.model, out_dir=cfg.out_dir))
    try:
        meta["versions"]["llama-cpp-python"] = version("llama-cpp-python")
    except PackageNotFoundError:
        meta["versions"]["llama-cpp-python"] = None
    meta["gguf"] = cfg.gguf
    return meta


def select_targets(cfg: RealConfig) -> tuple[list[str], dict[str, str]]:
    """The targets that can run here, and why the others cannot."""
    skipped: dict[str, str] = {}
    names = [t for t in REAL_TARGETS if t in cfg.targets]
    if "ours" in names and not _servers.ours_available():
        names.remove("ours")
        skipped[OURS] = "afm serve is not available (afm_http._serve_cli not importable)"
    if "llamacpp" in names:
        why = _servers.llamacpp_unavailable()
        if why is None and not (cfg.gguf and Path(cfg.gguf).is_file()):
            why = f"no GGUF file for llama.cpp (got {cfg.gguf!r}; give --gguf FILE)"
        if why is not None:
            names.remove("llamacpp")
            skipped[LLAMACPP] = why
            _log(f"skipping {LLAMACPP}: {why}")
    return names, skipped


async def run_real(cfg: RealConfig) -> dict[str, Any]:
    """Run the real-model comparison and return its report dict."""
    if cfg.rounds < 1:
        raise ValueError("rounds must be >= 1")
    names, skipped = select_targets(cfg)

    tokenizer = None
    if names:
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(Path(cfg.model))
    phases, prompt_means = make_phases(cfg, tokenizer)
    meta = _meta(cfg)
    est = expected_seconds(cfg, tuple(names))
    _log(f"real-model run: targets {', '.join(TARGET_NAMES[n] for n in names) or 'none'}, "
         f"{cfg.rounds} rounds; expected about {est / 60:.0f} min on a 2-core machine "
         f"(bounded by --time-budget {cfg.time_budget:g} s)")
    for ph in phases:
        mean = prompt_means.get(ph.name)
        _log(f"phase {ph.name}: {ph.title}"
             + (f"; prompts {mean:.0f} tokens on average" if mean is not None else ""))

    runs: list[RunResult] = []
    servers: dict[str, dict[str, Any]] = {}
    pids: dict[str, int] = {}
    log_dir = Path(cfg.out_dir) / "logs"
    t0 = time.perf_counter()
    Driver = Callable[[Phase, int, int], Awaitable[RunResult]]

    def sample_rss() -> None:
        for name, pid in pids.items():
            rss = _servers.peak_rss_bytes(pid)
            if rss is not None:
                entry = servers.setdefault(name, {})
                entry["peak_rss_bytes"] = max(rss["peak"], entry.get("peak_rss_bytes", 0))
                entry["rss_bytes"] = rss.get("current")

    async def open_target(key: str, stack: AsyncExitStack) -> tuple[str, Driver] | None:
        name = TARGET_NAMES[key]
        if key in ("raw", "raw_kernels"):
            # raw_kernels: raw with afm's CPU kernels (afm_core._mlx.fusion), the same
            # model computation as afm serve, without its server
            runner = RawRunner(cfg.model, kernels=key == "raw_kernels", name=name)
            stack.push_async_callback(runner.aclose)
            _log(f"loading {name} (in-process mlx-lm) from {cfg.model}")
            await runner.load()

            async def raw_level(ph: Phase, first: int, n: int) -> RunResult:
                return await runner.run_closed(ph.workload, ph.concurrency, n,
                                               level_timeout=cfg.level_timeout,
                                               first_index=first)

            pids[name] = os.getpid()
            servers[name] = {"process": "this benchmark process (raw runs in it)"}
            return name, raw_level
        port = _servers.free_port()
        if key == "peer":
            spec = _servers.peer_spec(cfg.model, port, decode_concurrency=cfg.batch_concurrency,
                                      extra=cfg.peer_args)
        elif key == "ours":
            spec = _servers.ours_spec(cfg.model, port, max_batch=cfg.batch_concurrency,
                                      extra=cfg.serve_args)
        else:
            assert cfg.gguf is not None
            spec = _servers.llamacpp_spec(cfg.gguf, port, threads=cfg.llamacpp_threads,
                                          n_ctx=cfg.llamacpp_ctx, extra=cfg.llamacpp_args)
        _log(f"starting {spec.name}: {' '.join(a if len(a) < 200 else '<launcher>' for a in spec.argv)}")
        t_start = time.perf_counter()
        try:
            running = await stack.enter_async_context(_servers.serving_process(
                spec, port, log_dir, startup_timeout=cfg.startup_timeout))
        except ServerStartError as exc:
            skipped[spec.name] = f"failed to start: {str(exc)[:500]}"
            _log(skipped[spec.name])
            return None
        stack.callback(_log, f"stopped {spec.name}")
        pids[name] = running.pid
        servers[name] = {"pid": running.pid, "startup_s": time.perf_counter() - t_start,
                         "log": str(running.log_path)}
        if key == "ours":
            servers[name]["blas"] = await _health_blas(running.base_url)
        target = _loadgen.Target(spec.name, running.base_url, model=spec.model_field,
                                 count_chunks=key == "llamacpp")

        async def served_level(ph: Phase, first: int, n: int) -> RunResult:
            return await _loadgen.run_closed(target, ph.workload, ph.concurrency, n,
                                             level_timeout=cfg.level_timeout,
                                             request_timeout=cfg.request_timeout,
                                             first_index=first)

        return name, served_level

    with trio.move_on_after(cfg.time_budget) as budget:
        async with AsyncExitStack() as stack:
            drivers: list[tuple[str, Driver]] = []
            for key in names:
                opened = await open_target(key, stack)
                if opened is not None:
                    drivers.append(opened)
            sample_rss()
            if cfg.warmup > 0:
                for name, drive in drivers:
                    _log(f"warming up {name}")
                    for ph in phases:
                        await drive(ph, ph.first_index(cfg.rounds), cfg.warmup)
            for r in range(cfg.rounds):
                order = drivers if r % 2 == 0 else drivers[::-1]
                for ph in phases:
                    for name, drive in order:
                        run = await drive(ph, ph.first_index(r), ph.requests)
                        run.mode, run.round = ph.name, r
                        runs.append(run)
                        sample_rss()
                        s = run.summary()
                        dec = [x for x in (s["tpot_ms"]["p50"],) if x]
                        _log(f"round {r + 1}/{cfg.rounds} {ph.name} {name}: {s['ok']}/{s['requests']} ok, "
                             f"{s['output_tokens_per_s'] or 0:.1f} tok/s, "
                             f"decode {1000 / dec[0] if dec else 0:.1f} tok/s, "
                             f"TTFT p50 {s['ttft_ms']['p50'] or 0:.0f} ms, errors {s['error_count']}")
            sample_rss()
            if PEER in servers:
                servers[PEER]["blas"] = _servers.blas_from_log(Path(servers[PEER]["log"]))
            for raw_name in (RAW, RAW_KERNELS):
                if raw_name in servers:
                    from afm_core._mlx.blas import blas_info

                    servers[raw_name]["blas"] = blas_info().as_dict()
            if LLAMACPP in servers:
                info = await trio.to_thread.run_sync(_llamacpp_system_info)
                servers[LLAMACPP]["blas"] = _llamacpp_blas(info)
    if budget.cancelled_caught:
        skipped["time_budget"] = f"total time budget of {cfg.time_budget:g} s ran out"
    meta["elapsed_s"] = time.perf_counter() - t0
    meta["expected_s"] = est
    meta["loadavg_end"] = list(os.getloadavg())
    config = asdict(cfg)
    phase_desc = [{"name": ph.name, "title": ph.title, "concurrency": ph.concurrency,
                   "requests_per_round": ph.requests,
                   "max_tokens": ph.workload.jobs[0].max_tokens,
                   "prompt_words": len(ph.workload.jobs[0].messages[-1]["content"].split()),
                   "prompt_tokens_mean": prompt_means.get(ph.name)} for ph in phases]
    report = build_real_report(runs, phases=phase_desc, servers=servers, meta=meta,
                               config=config, skipped=skipped)
    notes = []
    if LLAMACPP in servers:
        notes.append("llama.cpp: llama_cpp.server serves one request at a time (0.3.36 has no "
                     "parallel-slots setting); run with --interrupt_requests False so queued "
                     "requests wait instead of cutting the running stream short; its C=8 figure "
                     "is sequential service (TTFT includes the queue).  Tokens counted from "
                     "stream chunks when it sends no usage.")
    report["notes"] = notes
    json.dumps(report, default=str)  # fail here, not in write_report, on a bad value
    return report
