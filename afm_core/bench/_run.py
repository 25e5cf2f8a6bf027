"""One benchmark run: raw, then each server, level by level, then the report.

Targets are never measured at the same time (the model would compete with
itself for the same cores).  By default each target runs all its levels and
is stopped before the next starts (one model in memory at a time); with
``interleave`` all targets are up at once and each level runs on every
target back to back, so slow drift in machine load hits all of them alike.
Each target gets the same jobs at the same level, warms up first, and is
bounded by the level and total time budgets; servers started here are always
stopped on the way out.

With several wire APIs (``apis``, ``afm bench --api chat,messages,...``) each
server is started once, and each API *slot* (``_apis.slot_names``) is a
target of its own on it (``ours[chat]``, ``ours[messages]``...).  Every slot
runs the same jobs, so two APIs differ only by the API: the servers' prompt
caches are switched off for such a run (``--prefix-cache-bytes 0``, and
``--prompt-cache-bytes 0`` for mlx_lm.server), else the second API to send a
prompt would find it cached.  Completions sends the chat template's text
(``_workload.templated``, with ``add_special_tokens: false``), so every API
prefills the same tokens and decodes the same answer, and one raw target,
``raw[chat]``, is every API's baseline (``run_form``; the run checks each
request's prompt tokens against it).
Each round (``multi_round``) runs the raw targets, then the served slots in
the order of a Williams design (``round_order``: over a few rounds every
slot runs in every position and right after every other slot equally
often, so neither position nor what ran just before favours an API); every
other round the raw targets move to the end, in an order rotated every two
rounds, so each is the one right after a served level equally often.  A
served level also measures the server process's CPU time (``server_cpu_s``,
where the OS tells it).
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trio

from . import _loadgen, _servers
from ._apis import APIS, prompt_form, slot_api, slot_names, slot_target, split_target
from ._errors import ServerStartError
from ._raw import RawRunner
from ._report import OURS, PEER, RAW, RAW_KERNELS, build_report
from ._results import RunResult
from ._workload import Workload, make_workload, poisson_schedule, templated

ALL_TARGETS = ("raw", "raw_kernels", "peer", "ours")
DEFAULT_TARGETS = ("raw", "peer", "ours")


T = TypeVar("T")

PEER_APIS = ("chat", "completions")
"""The wire APIs mlx_lm.server serves."""


@dataclass(slots=True)
class BenchConfig:
    """Everything that defines a run; stored verbatim in the report."""

    model: str
    out_dir: str
    targets: tuple[str, ...] = DEFAULT_TARGETS
    api: str = "chat"  # the wire API the served targets are driven through (_apis.APIS)
    apis: tuple[str, ...] = ()  # two or more: every one in this run, a target each (api unused)
    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    requests: int | None = None  # per closed level; None -> max(32, 4 * c)
    rates: tuple[float, ...] = ()
    open_requests: int = 64
    max_tokens: tuple[int, int] = (64, 64)
    prompt_words: tuple[int, int] = (16, 64)
    seed: int = 0
    warmup: int = 4
    request_timeout: float = 120.0
    level_timeout: float = 300.0
    time_budget: float = 1800.0
    startup_timeout: float = 180.0
    max_batch: int | None = None  # both servers; None -> the largest level
    profile: bool = False
    interleave: bool = False  # all targets up at once, level by level
    rounds: int = 1  # runs of every level per target, each on fresh jobs
    url: str | None = None
    url_model: str | None = None
    serve_args: tuple[str, ...] = ()
    peer_args: tuple[str, ...] = ()
    model_was_generated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def requests_at(self, c: int) -> int:
        return self.requests if self.requests is not None else max(32, 4 * c)

    def slots(self) -> tuple[str, ...]:
        """The API slots of a run over several APIs (``apis``); () for one API."""
        return slot_names(self.apis) if len(self.apis) > 1 else ()


@dataclass(frozen=True, slots=True)
class Level:
    mode: str
    level: float
    n: int
    first_index: int
    schedule: tuple[float, ...] = ()
    round: int = 0



def plan(cfg: BenchConfig) -> tuple[Workload, list[Level], Level]:
    """The seeded workload, the levels (each level's rounds one after the
    other) and the warm-up, on disjoint job ranges (so no target sees a
    prompt twice and prefix caches only ever share the chat template's
    header).  Every API slot of a run over several APIs runs its level's
    range (the servers' prompt caches are off in such a run)."""
    if cfg.rounds < 1:
        raise ValueError("rounds must be >= 1")
    levels: list[Level] = []
    nxt = 0
    for c in cfg.concurrency:
        n = cfg.requests_at(c)
        for r in range(cfg.rounds):
            levels.append(Level("closed", float(c), n, nxt, round=r))
            nxt += n
    for k, rate in enumerate(cfg.rates):
        sched = tuple(poisson_schedule(rate, cfg.open_requests, cfg.seed + 1000 + k))
        for r in range(cfg.rounds):
            levels.append(Level("open", rate, cfg.open_requests, nxt, sched, round=r))
            nxt += cfg.open_requests
    warm_c = max(1, min(4, max(cfg.concurrency, default=1)))
    warmup = Level("closed", float(warm_c), cfg.warmup, nxt)
    workload = make_workload(cfg.seed, max(1, nxt + cfg.warmup), prompt_words=cfg.prompt_words,
                             max_tokens=cfg.max_tokens)
    return workload, levels, warmup


def round_order(k: int, r: int) -> list[int]:
    """Round ``r``'s order of ``k`` slots, a row of a Williams design: over
    ``k`` rounds (``2k`` when ``k`` is odd) each slot runs in each position,
    and right after each other slot, equally often."""
    if k < 1:
        return []
    base, lo, hi = [0], 1, k - 1
    while len(base) < k:
        base.append(lo if len(base) % 2 else hi)
        if len(base) % 2 == 0:
            lo += 1
        else:
            hi -= 1
    row = [(b + r) % k for b in base]
    return row[::-1] if k % 2 and (r // k) % 2 else row


def multi_round(raws: list[T], served: list[list[T]], r: int) -> list[T]:
    """Round ``r`` of a run over several APIs: the served slots (each a
    list of targets) in ``round_order``, the raw targets before them on
    even rounds and after them on odd ones, rotated every two rounds, so
    that each raw target is the one right after a served level equally
    often (whatever a level leaves behind weighs on all of them alike)."""
    order = [d for k in round_order(len(served), r) for d in served[k]]
    shift = (r // 2) % len(raws) if raws else 0
    rotated = raws[shift:] + raws[:shift]
    return rotated + order if r % 2 == 0 else order + rotated


PROMPT_CACHE_OFF = {"ours": ("--prefix-cache-bytes", "0"), "peer": ("--prompt-cache-bytes", "0")}
"""Each server's switch for its prompt cache, off in a run over several APIs."""


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) process ``pid`` has used so far,
    from ``/proc``; None where the OS has no ``/proc`` (macOS)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _log(msg: str) -> None:
    print(f"[afm bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _brief(run: RunResult) -> str:
    s = run.summary()
    ttft = s["ttft_ms"]["p50"]
    return (f"{run.target} {run.label}: {s['ok']}/{s['requests']} ok, "
            f"{s['output_tokens_per_s'] or math.nan:.1f} tok/s, "
            f"TTFT p50 {ttft if ttft is not None else math.nan:.1f} ms, errors {s['errors']}")


class _Served:
    """A served target: one level is one load-generator run (and, given the
    server's ``pid``, the CPU time the server used meanwhile)."""

    def __init__(self, target: _loadgen.Target, workload: Workload, cfg: BenchConfig,
                 pid: int | None = None) -> None:
        self.name = target.name
        self._target, self._workload, self._cfg, self._pid = target, workload, cfg, pid

    async def level(self, lv: Level) -> RunResult:
        cfg = self._cfg
        cpu0 = cpu_seconds(self._pid) if self._pid is not None else None
        if lv.mode == "closed":
            run = await _loadgen.run_closed(
                self._target, self._workload, int(lv.level), lv.n,
                level_timeout=cfg.level_timeout, request_timeout=cfg.request_timeout,
                first_index=lv.first_index)
        else:
            run = await _loadgen.run_open(
                self._target, self._workload, lv.level, lv.schedule,
                level_timeout=cfg.level_timeout, request_timeout=cfg.request_timeout,
                first_index=lv.first_index)
        cpu1 = cpu_seconds(self._pid) if cpu0 is not None and self._pid is not None else None
        run.server_cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        return run


class _Raw:
    """The in-process raw limit."""

    def __init__(self, runner: RawRunner, workload: Workload, cfg: BenchConfig,
                 name: str | None = None) -> None:
        self._runner, self._workload, self._cfg = runner, workload, cfg
        self.name = name or runner.name

    async def level(self, lv: Level) -> RunResult:
        if lv.mode == "closed":
            run = await self._runner.run_closed(self._workload, int(lv.level), lv.n,
                                                level_timeout=self._cfg.level_timeout,
                                                first_index=lv.first_index)
        else:
            run = await self._runner.run_open(self._workload, lv.level, lv.schedule,
                                              level_timeout=self._cfg.level_timeout,
                                              first_index=lv.first_index)
        run.target = self.name
        return run


_Driver = _Served | _Raw


def _meta(cfg: BenchConfig) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    import mlx.core as mx

    def ver(pkg: str) -> str | None:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    model_cfg: dict[str, Any] = {}
    try:
        import json

        raw_cfg = json.loads((Path(cfg.model) / "config.json").read_text())
        keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "torch_dtype")
        model_cfg = {k: raw_cfg.get(k) for k in keys if k in raw_cfg}
    except (OSError, ValueError):
        pass
    return {
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "model": cfg.model,
        "model_config": model_cfg,
        "model_generated": cfg.model_was_generated,
        "afm_commit": commit or None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()),
        "mlx_device": str(mx.default_device()),
        "versions": {p: ver(p) for p in ("mlx", "mlx-lm", "h11", "trio")},
    }


def run_form(api: str, multi: bool) -> str:
    """How raw tokenizes ``api``'s prompts in a run: ``_apis.prompt_form``,
    except that in a run over several APIs completions sends the chat
    template's text (``_workload.templated``), so every API shares ``chat``."""
    return "chat" if multi else prompt_form(api)


def _chat_renderer(model_dir: str) -> Any:
    """The model's chat template as text (generation prompt included)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model_dir))

    def render(messages: list[dict[str, str]]) -> str:
        return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False))
    return render


def _prompt_token_check(runs: list[RunResult], raw_tokens: dict[str, list[int]],
                        workload: Workload, api: str, forms: dict[str, str]) -> dict[str, Any]:
    """Does each server count the same prompt tokens as the raw path?
    ``raw_tokens`` is raw's count of every job by prompt form (``forms``,
    by API: ``run_form``); a target's API is its slot's, else ``api``."""
    out: dict[str, Any] = {}
    for run in runs:
        kind, slot = split_target(run.target)
        if kind in (RAW, RAW_KERNELS):
            continue
        target_api = slot_api(slot) if slot is not None else api
        counts = raw_tokens.get(forms[target_api])
        if not counts:
            continue
        seen = [(r.index, r.prompt_tokens) for r in run.requests if r.prompt_tokens is not None]
        bad = sum(1 for i, n in seen if counts[i % len(workload.jobs)] != n)
        agg = out.setdefault(run.target, {"checked": 0, "mismatched": 0})
        agg["checked"] += len(seen)
        agg["mismatched"] += bad
    return out


async def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run every requested target and return the report dict."""
    workload, levels, warmup = plan(cfg)
    runs: list[RunResult] = []
    skipped: dict[str, str] = {}
    raw_tokens: dict[str, list[int]] = {}  # raw's prompt lengths by prompt form
    log_dir = Path(cfg.out_dir) / "logs"
    meta = _meta(cfg)
    t0 = time.perf_counter()
    batch = cfg.max_batch or max(cfg.concurrency, default=32)
    slots = cfg.slots()  # () in a one-API run: plain target names, cfg.api
    multi = bool(slots)
    apis = [slot_api(s) for s in slots] if multi else [cfg.api]
    if multi and "completions" in apis:
        workload = templated(workload, _chat_renderer(cfg.model))
    forms = {api: run_form(api, multi) for api in APIS}  # raw's prompt form per API

    names = [t for t in ALL_TARGETS if t in cfg.targets]
    if "ours" in names and not _servers.ours_available():
        names.remove("ours")
        skipped[OURS] = "afm serve is not available (afm_http._serve_cli not importable)"
    if "peer" in names and not any(a in PEER_APIS for a in apis):
        names.remove("peer")
        skipped[PEER] = f"mlx_lm.server does not serve the {' or '.join(dict.fromkeys(apis))} API"
    if "peer" in names and multi:
        for slot in slots:
            if slot_api(slot) not in PEER_APIS:
                skipped[slot_target(PEER, slot)] = (f"mlx_lm.server does not serve the "
                                                    f"{slot_api(slot)} API")
    if cfg.url:
        _loadgen.require_loopback(cfg.url)
        names.append("url")

    async def open_drivers(name: str, stack: AsyncExitStack) -> dict[str, _Driver]:
        """Start (or load) one target inside ``stack``: its driver, or one
        per API slot (raw: per prompt form); keyed by slot or form ("" in a
        one-API run); empty if it failed."""
        if name in ("raw", "raw_kernels"):
            kernels = name == "raw_kernels"
            label = RAW_KERNELS if kernels else RAW
            runners: dict[str, RawRunner] = {}  # one loaded model per prompt form
            for api in apis:
                form = forms[api]
                if form not in runners:
                    runner = RawRunner(cfg.model, kernels=kernels, name=label, api=form)
                    stack.push_async_callback(runner.aclose)
                    await runner.load()
                    counts = await runner.prompt_tokens(workload)  # tokenized before timing
                    raw_tokens.setdefault(form, counts)  # raw+kernels tokenizes as raw does
                    runners[form] = runner
            if not multi:
                return {"": _Raw(runners[forms[cfg.api]], workload, cfg)}
            return {form: _Raw(runner, workload, cfg, name=slot_target(label, form))
                    for form, runner in runners.items()}
        pid: int | None = None
        if name == "url":
            assert cfg.url is not None
            base, label, model_field = cfg.url, "url", cfg.url_model
        else:
            port = _servers.free_port()
            if name == "peer":
                extra = cfg.peer_args + (PROMPT_CACHE_OFF["peer"] if multi else ())
                spec = _servers.peer_spec(cfg.model, port, decode_concurrency=batch, extra=extra)
            else:
                extra = cfg.serve_args + (PROMPT_CACHE_OFF["ours"] if multi else ())
                spec = _servers.ours_spec(cfg.model, port, max_batch=batch, extra=extra)
            _log(f"starting {spec.name}: {' '.join(spec.argv)}")
            meta.setdefault("servers", {})[spec.name] = list(spec.argv)
            try:
                running = await stack.enter_async_context(_servers.serving_process(
                    spec, port, log_dir, startup_timeout=cfg.startup_timeout))
            except ServerStartError as exc:
                skipped[spec.name] = f"failed to start: {str(exc)[:500]}"
                _log(skipped[spec.name])
                return {}
            stack.callback(_log, f"stopped {spec.name}")
            base, pid = running.base_url, running.pid
            label, model_field = spec.name, spec.model_field

        def served(target: str, api: str) -> _Served:
            return _Served(_loadgen.Target(target, base, model=model_field, profile=cfg.profile,
                                           api=api), workload, cfg, pid=pid)

        if not multi:
            return {"": served(label, cfg.api)}
        return {slot: served(slot_target(label, slot), slot_api(slot))
                for slot in slots if name != "peer" or slot_api(slot) in PEER_APIS}

    async def warm(driver: _Driver) -> None:
        if warmup.n > 0:
            await driver.level(warmup)

    async def one_level(driver: _Driver, lv: Level) -> None:
        run = await driver.level(lv)
        run.round = lv.round
        runs.append(run)
        _log(_brief(run) + (f" (round {lv.round + 1}/{cfg.rounds})" if cfg.rounds > 1 else ""))

    with trio.move_on_after(cfg.time_budget) as budget:
        if multi:
            # every target up at once; per round the raw targets, then the
            # served slots in a Williams design's order (see round_order)
            async with AsyncExitStack() as stack:
                opened = [await open_drivers(n, stack) for n in names]
                raws: list[_Driver] = [d for by in opened for d in by.values()
                                       if isinstance(d, _Raw)]
                served_slots: list[list[_Driver]] = [
                    [by[s] for by in opened if s in by and isinstance(by[s], _Served)]
                    for s in slots]
                for d in raws + [d for group in served_slots for d in group]:
                    await warm(d)
                for lv in levels:
                    for d in multi_round(raws, served_slots, lv.round):
                        await one_level(d, lv)
        elif cfg.interleave:
            # every target up at once; each level runs on all targets back to back
            async with AsyncExitStack() as stack:
                drivers = [d for n in names for d in (await open_drivers(n, stack)).values()]
                for d in drivers:
                    await warm(d)
                for lv in levels:
                    # a level's rounds alternate the order (A B, B A, ...) so that
                    # neither side always runs first after the other
                    for d in drivers if lv.round % 2 == 0 else drivers[::-1]:
                        await one_level(d, lv)
        else:
            for n in names:
                _log(f"target {n}")
                async with AsyncExitStack() as stack:
                    for d in (await open_drivers(n, stack)).values():
                        await warm(d)
                        for lv in levels:
                            await one_level(d, lv)
    if budget.cancelled_caught:
        skipped["time_budget"] = f"total time budget of {cfg.time_budget:g} s ran out"
    config = asdict(cfg)
    if multi:
        config["interleave"] = True  # several APIs always run interleaved
        config["slots"] = list(slots)
        config["raw_forms"] = {slot: forms[slot_api(slot)] for slot in slots}
    config["workload"] = workload.describe()
    meta["elapsed_s"] = time.perf_counter() - t0
    meta["loadavg_end"] = list(os.getloadavg())
    report = build_report(runs, meta=meta, config=config, skipped=skipped)
    report["checks"] = {"prompt_tokens_vs_raw":
                        _prompt_token_check(runs, raw_tokens, workload, cfg.api, forms)}
    return report
