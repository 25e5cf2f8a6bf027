"""``afm bench --speculation``: speculative decoding on a real model, against llama.cpp.

Issue 29 §2: at one stream a model's decode is bound by the bytes of weights
each token reads; speculation reads them once per verify pass for several
tokens.  On ``--spec-model`` (default Qwen2.5-Coder-1.5B) this mode runs,
all up at once, in interleaved rounds (order reversed every other round):

* ``ours``: ``afm serve``, no speculation (``--spec-max-batch 0``);
* ``ours_lookup`` (``ours+lookup``): prompt lookup (``--prompt-lookup K``;
  by default ``auto``, the server's automatic setting: 4 tokens a step with
  the VNNI kernels, 2 with the others, off below 256 MiB of weights),
  drafts that read no weights;
* ``ours_draft`` (``ours+draft``): ``--spec-draft`` (default
  Qwen2.5-Coder-0.5B, the same tokenizer) as the engine's ``draft_model``,
  ``--draft-tokens K``;
* ``llamacpp``: llama.cpp's server loop, no speculation (the baseline);
* ``llamacpp_draft`` (``llama.cpp+draft``): the same with the same draft
  model (``speculative.types DRAFT_SIMPLE``, ``n_max`` K): the strongest peer.

Two workloads of greedy single-stream requests (``_spec_prompts``): ``chat``
(short essays: little to look up) and ``code_edit`` (the model rewrites a
file it was given with one rename: the output repeats the prompt).  Per
target and workload the report gives the decode tok/s (median per request,
prefill left out), its ratio to ``ours`` and to llama.cpp (medians of the
rounds' paired ratios), the acceptance (accepted / proposed: afm's
``/metrics`` counters before and after each level, llama.cpp's ``timings``
``draft_n`` and ``draft_n_accepted``), whether the text equals the plain
target's of the same server (greedy speculation must give the same tokens),
and the bytes of weights read per emitted token::

    bytes/token = (proposed x B_draft + verify_and_plain_steps x B_model) / decoded tokens

where ``verify_and_plain_steps = decoded - accepted`` (every step emits one
token of its own plus the accepted ones) and ``B`` is the bytes a forward
pass reads (``_real_models.forward_bytes``: the GGUF's tensors).  Below
``B_model`` it pays in bandwidth; the draft needs an acceptance above
``B_draft / B_model`` (printed as ``break-even``) for that.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from . import _spec_prompts
from ._errors import ServerStartError
from ._llamacpp import LLAMACPP
from ._real import Stopper, run_meta
from ._real_models import ModelSpec, resolve_specs
from ._real_report import decode_rates
from ._real_targets import Opened, TargetContext, open_target, probe_info, unavailable
from ._results import RunResult
from ._spec_report import build_spec_report, bytes_per_token
from ._stats import ratio
from ._workload import Workload

__all__ = ["SPEC_TARGETS", "SpecConfig", "bytes_per_token", "parse_spec_metrics", "run_speculation"]

SPEC_TARGETS = ("ours", "ours_lookup", "ours_draft", "llamacpp", "llamacpp_draft")
SPEC_NAMES = {"ours": "ours", "ours_lookup": "ours+lookup", "ours_draft": "ours+draft",
              "llamacpp": LLAMACPP, "llamacpp_draft": "llama.cpp+draft"}
_METRICS = {"afm_spec_steps_total": "steps", "afm_spec_proposed_tokens_total": "proposed",
            "afm_spec_accepted_tokens_total": "accepted"}


@dataclass(slots=True)
class SpecConfig:
    """Everything that defines a speculation run; stored verbatim in the report."""

    out_dir: str
    model: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    gguf_dir: tuple[str, ...] = ()
    targets: tuple[str, ...] = SPEC_TARGETS
    rounds: int = 2
    requests: int = 1  # per workload per round
    max_tokens: int = 320
    draft_tokens: int = 4
    lookup: int | None = None  # None: the server's automatic setting
    warmup: int = 1
    threads: int | None = None
    seed: int = 0
    request_timeout: float = 1800.0
    startup_timeout: float = 600.0
    time_budget: float = 14400.0
    serve_args: tuple[str, ...] = ()
    llamacpp_settings: tuple[str, ...] = ()


def _log(msg: str) -> None:
    print(f"[afm bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _resolve(item: str, gguf_dir: tuple[str, ...]) -> ModelSpec:
    path = Path(item).expanduser()
    if path.is_dir():
        specs, _ = resolve_specs((), model_dir=str(path))
    else:
        specs, missing = resolve_specs((item,), gguf_dir=gguf_dir)
        if not specs:
            raise FileNotFoundError(next(iter(missing.values()), f"cannot find {item!r}"))
    return specs[0]


def _draft_source(draft: ModelSpec) -> str | None:
    return draft.afm_model or draft.directory


def _plan(cfg: SpecConfig, model: ModelSpec, draft: ModelSpec, ctx: TargetContext) -> \
        tuple[list[tuple[str, str, tuple[str, ...]]], dict[str, str]]:
    """(target key, name, extra server arguments) of every target that can run."""
    plans, skipped = [], {}
    for key in SPEC_TARGETS:
        if key not in cfg.targets:
            continue
        base = "ours" if key.startswith("ours") else "llamacpp"
        name = SPEC_NAMES[key]
        why = unavailable(base, model, ctx)
        extra: tuple[str, ...] = ()
        if key == "ours":
            extra = ("--spec-max-batch", "0")
        elif key == "ours_lookup":
            extra = ("--prompt-lookup", "auto" if cfg.lookup is None else str(cfg.lookup), "--spec-max-batch", "1")
        elif key == "ours_draft":
            why = why or (draft.afm_error and f"the draft: {draft.afm_error}")
            extra = ("--draft-model", str(_draft_source(draft)), "--draft-tokens",
                     str(cfg.draft_tokens), "--spec-max-batch", "1")
        elif key == "llamacpp_draft":
            why = why or (None if draft.gguf else "no GGUF file of the draft model")
            extra = ("speculative.types=DRAFT_SIMPLE", f"speculative.draft.mparams.path={draft.gguf}",
                     f"speculative.draft.n_max={cfg.draft_tokens}",
                     f"speculative.draft.cpuparams.n_threads={ctx.threads}",
                     f"speculative.draft.cpuparams_batch.n_threads={ctx.threads}")
        if why:
            skipped[name] = why
            _log(f"skipping {name}: {why}")
        else:
            plans.append((base, name, extra))
    return plans, skipped


def parse_spec_metrics(text: str) -> dict[str, float]:
    """afm's speculation counters in a ``/metrics`` page (summed over models)."""
    out = dict.fromkeys(_METRICS.values(), 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _METRICS:
            try:
                out[_METRICS[name]] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return out


async def spec_counters(base_url: str) -> dict[str, float]:
    """afm's speculation counters now (zeros when ``/metrics`` cannot be read)."""
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            text = (await client.get(base_url + "/metrics")).text
    except httpx.HTTPError:
        text = ""
    return parse_spec_metrics(text)


async def _level(o: Opened, wl: Workload, first: int, n: int, cfg: SpecConfig) -> \
        tuple[RunResult, dict[str, float]]:
    """One level on one target and its speculation counters over it."""
    afm = o.key == "ours"
    before = await spec_counters(o.base_url) if afm and o.base_url else None
    run = await o.drive(wl, 1, first, n, cfg.request_timeout * n + 60.0, cfg.request_timeout)
    counters: dict[str, float] = {}
    if before is not None and o.base_url:
        after = await spec_counters(o.base_url)
        counters = {k: after[k] - before[k] for k in after}
    else:  # llama.cpp: its own per-request timings
        counters = {"proposed": float(sum((q.timings or {}).get("draft_n", 0) for q in run.requests)),
                    "accepted": float(sum((q.timings or {}).get("draft_n_accepted", 0)
                                          for q in run.requests))}
    return run, counters


async def run_speculation(cfg: SpecConfig) -> dict[str, Any]:
    """Run the speculation comparison and return its report dict."""
    from afm_core._mlx.blas import physical_cores

    model, draft = await trio.to_thread.run_sync(
        lambda: (_resolve(cfg.model, cfg.gguf_dir), _resolve(cfg.draft, cfg.gguf_dir)))
    threads = cfg.threads or physical_cores()
    n_ctx = 4096 if not model.context else min(4096, model.context)
    ctx = TargetContext(log_dir=Path(cfg.out_dir) / "logs", threads=threads,
                        threads_explicit=cfg.threads is not None, max_batch=1, n_ctx=n_ctx,
                        startup_timeout=cfg.startup_timeout, serve_args=cfg.serve_args,
                        llamacpp_settings=cfg.llamacpp_settings)
    plans, skipped = _plan(cfg, model, draft, ctx)
    workloads = _spec_prompts.workloads(cfg.rounds * cfg.requests + cfg.warmup, cfg.max_tokens)
    runs: list[RunResult] = []
    counters: dict[tuple[str, str, int], dict[str, float]] = {}
    servers: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    meta = run_meta(cfg.out_dir)
    stopper = Stopper(trio.current_time() + cfg.time_budget)
    async with trio.open_nursery() as nursery:
        await nursery.start(stopper.watch_signals)
        await _run_targets(cfg, model, ctx, plans, workloads, stopper, runs, counters, servers,
                           skipped, threads)
        nursery.cancel_scope.cancel()
    meta["elapsed_s"] = time.perf_counter() - t0
    report = build_spec_report(runs, counters, model=model.describe(), draft=draft.describe(),
                               servers=servers, skipped=skipped, meta=meta, config=asdict(cfg),
                               workloads={k: w.describe() for k, w in workloads.items()})
    json.dumps(report, default=str)
    return report


async def _run_targets(cfg: SpecConfig, model: ModelSpec, ctx: TargetContext,
                       plans: list[tuple[str, str, tuple[str, ...]]], workloads: dict[str, Workload],
                       stopper: Stopper, runs: list[RunResult],
                       counters: dict[tuple[str, str, int], dict[str, float]],
                       servers: dict[str, dict[str, Any]], skipped: dict[str, str],
                       threads: int) -> None:
    """Start every target, run the rounds (until ``stopper`` ends them), then
    read each target's RSS and what it computed with."""
    from ._servers import peak_rss_bytes

    async with AsyncExitStack() as stack:
        opened: list[Opened] = []
        with stopper.scope() as scope:
            for base, name, extra in plans:
                try:
                    opened.append(await open_target(base, model, ctx, stack, name=name, extra=extra,
                                                    log=_log, keep_text=True))
                except ServerStartError as exc:
                    skipped[name] = f"failed to start: {str(exc)[:500]}"
                    _log(skipped[name])
            for o in opened:
                servers[o.name] = dict(o.info)
            await _spec_rounds(cfg, opened, workloads, runs, counters)
        if scope.cancelled_caught:
            skipped["stopped"] = stopper.reason or f"the time budget of {cfg.time_budget:g} s ran out"
        for o in opened:
            rss = peak_rss_bytes(o.pid)
            servers.setdefault(o.name, {}).update(await probe_info(o, threads))
            servers[o.name]["peak_rss_bytes"] = rss["peak"] if rss else None


async def _spec_rounds(cfg: SpecConfig, opened: list[Opened], workloads: dict[str, Workload],
                       runs: list[RunResult], counters: dict[tuple[str, str, int], dict[str, float]]) -> None:
    first_warm = cfg.rounds * cfg.requests
    for o in opened:
        if cfg.warmup > 0:
            _log(f"warming up {o.name}")
            for wl in workloads.values():
                await _level(o, wl, first_warm, cfg.warmup, cfg)
    for r in range(cfg.rounds):
        order = opened if r % 2 == 0 else opened[::-1]
        for name, wl in workloads.items():
            for o in order:
                run, got = await _level(o, wl, r * cfg.requests, cfg.requests, cfg)
                run.mode, run.round = name, r
                runs.append(run)
                counters[(o.name, name, r)] = got
                rates = decode_rates(run)
                acc = ratio(got.get("accepted"), got.get("proposed"))
                _log(f"round {r + 1}/{cfg.rounds} {name} {o.name}: decode "
                     f"{statistics.median(rates) if rates else 0:.1f} tok/s"
                     + (f", acceptance {acc:.0%}" if acc is not None else ""))
