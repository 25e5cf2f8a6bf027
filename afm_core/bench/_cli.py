"""``afm bench``: served vs raw vs peers, side by side in one run.

Examples::

    afm bench                                   # tiny random model, raw + mlx_lm.server + ours
    afm bench --model DIR --concurrency 1,8 --requests 16 --max-tokens 32
    afm bench --targets raw,peer --rate 5,20    # add open-loop Poisson levels
    afm bench --targets raw --url http://127.0.0.1:8080   # an already running server
    afm bench --api messages --targets raw,ours # Anthropic /v1/messages (also completions, responses)
    afm bench --api chat,completions,messages,responses,chat --targets raw,ours
              --concurrency 1 --requests 1 --rounds 500
                                                # (one command) every API in one run on the same
                                                # prompts, request by request; chat twice: A/A
    afm bench --real-model                      # default model: raw, peer, ours vs llama.cpp
    afm bench --real-model --rounds 1 --batch-requests 8 --targets ours,llamacpp
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ._apis import APIS


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def _levels(text: str) -> tuple[int, ...]:
    """Closed-loop levels; "" or "none" for none (an open-loop-only run)."""
    return () if text.strip().lower() in ("", "none") else _ints(text)


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {text!r}") from exc
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("rates must be > 0")
    return values


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from exc
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"bad range {text!r}")
    return a, b


def _targets(text: str) -> tuple[str, ...]:
    from ._real import REAL_TARGETS
    from ._run import ALL_TARGETS

    known = ALL_TARGETS + tuple(t for t in REAL_TARGETS if t not in ALL_TARGETS)
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown targets {bad}; choose from {known}")
    return names


def _apis(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in APIS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown APIs {bad}; choose from {', '.join(APIS)}")
    return names


def _rounds(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 1000:
        raise argparse.ArgumentTypeError("rounds must be between 1 and 1000")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1] if __doc__ else None
    from ._run import DEFAULT_TARGETS

    a = parser.add_argument
    a("--model", default=None,
      help="mlx-lm model directory (default: a fresh random tiny test model)")
    a("--targets", type=_targets, default=None,
      help="comma list of raw, raw_kernels (raw with the engine's CPU kernels), peer "
           "(mlx_lm.server), ours (afm serve), llamacpp (--real-model only); default "
           + ",".join(DEFAULT_TARGETS) + " (with --real-model raw,peer,ours,llamacpp)")
    a("--api", type=_apis, default=("chat",),
      help="the wire API the served targets are driven through: chat (/v1/chat/completions), "
           "completions (/v1/completions: the prompt text raw, and raw mlx-lm without the chat "
           "template), messages (Anthropic /v1/messages), responses (/v1/responses); "
           "mlx_lm.server serves only chat and completions.  A comma list runs them all in one "
           "run, interleaved: one server per target (prompt caches off), a target per API on it "
           "(ours[messages]), every API on the same prompt tokens (completions sends the chat "
           "template's text) against one raw target, the APIs in a balanced (Williams) order "
           "each round; "
           "the same API twice (chat,chat) is an A/A control")
    a("--concurrency", type=_levels, default=(1, 8, 32, 64),
      help="closed-loop levels ('none' with --rate for open loop only)")
    a("--requests", type=int, default=None,
      help="requests per closed-loop level (default max(32, 4 x concurrency))")
    a("--rate", type=_floats, default=(), help="open-loop Poisson rates in req/s, comma list")
    a("--open-requests", type=int, default=64, help="requests per open-loop level")
    a("--max-tokens", type=_range, default=(64, 64), help="N or MIN:MAX completion tokens")
    a("--prompt-words", type=_range, default=(16, 64), help="N or MIN:MAX words per prompt")
    a("--seed", type=int, default=0, help="workload seed")
    a("--warmup", type=int, default=None,
      help="unrecorded warm-up requests per target (default 4; --real-model: 1 per phase)")
    a("--request-timeout", type=float, default=None,
      help="seconds per request (default 120; --real-model 300)")
    a("--level-timeout", type=float, default=None,
      help="seconds per level per target (default 300; --real-model 600)")
    a("--time-budget", type=float, default=None,
      help="seconds for the whole run (default 1800; --real-model 2400)")
    a("--startup-timeout", type=float, default=None,
      help="seconds for a server to be healthy (default 180; --real-model 300)")
    a("--max-batch", type=int, default=None,
      help="streams decoded together by both servers: afm serve --max-batch and "
           "mlx_lm.server --decode-concurrency (default: the largest level)")
    a("--interleave", action="store_true",
      help="start every target up front and run each level on all of them back to back "
           "(fairer on a busy machine; all models in memory at once)")
    a("--rounds", type=_rounds, default=None,
      help="run every level this many times per target, each time on fresh prompts; ratios "
           "are the medians of the rounds' paired ratios (steadier on a busy machine; "
           "with --interleave the order alternates each round); default 1 (--real-model 2)")
    a("--profile", action="store_true", help="send X-AFM-Profile: extended and keep the profiles")
    a("--url", default=None, help="also benchmark an already running loopback server")
    a("--url-model", default=None, help="'model' field for --url (default: omitted)")
    a("--serve-arg", action="append", default=[], help="extra argument for afm serve")
    a("--peer-arg", action="append", default=[], help="extra argument for mlx_lm.server")
    a("--out", default=None, help="output directory (default bench-results/bench-TIMESTAMP)")
    real = parser.add_argument_group(
        "real-model mode", "the default model (SmolLM2-135M-Instruct, as afm serve loads it) "
        "through raw mlx-lm, mlx_lm.server and afm serve against llama.cpp "
        "(llama-cpp-python's server) on the same GGUF file, in interleaved rounds")
    r = real.add_argument
    r("--real-model", action="store_true",
      help="run the real-model comparison instead of the load levels above")
    r("--gguf", default=None,
      help="GGUF file for llama.cpp (default: the default model's, when --model is not given)")
    r("--decode-tokens", type=int, default=128, help="tokens per single-stream request")
    r("--decode-requests", type=int, default=2, help="single-stream requests per round")
    r("--batch-requests", type=int, default=8, help="requests per round at 8 streams")
    r("--batch-tokens", type=int, default=64, help="tokens per request at 8 streams")
    r("--ttft-prompt-tokens", type=int, default=512, help="prompt length of the TTFT phase")
    r("--ttft-requests", type=int, default=2, help="TTFT requests per round")
    r("--llamacpp-threads", type=int, default=2, help="llama.cpp's --n_threads (and batch)")
    r("--llamacpp-arg", action="append", default=[],
      help="extra argument for python -m llama_cpp.server")


def run_real_model(args: argparse.Namespace) -> int:
    """``afm bench --real-model``: see ``afm_core.bench._real``."""
    import trio

    from afm_core._errors import ModelLoadError
    from afm_core._models.default_model import fetch_default_gguf
    from afm_core._models.resolve import resolve_model

    from ._real import DEFAULT_REAL_TARGETS, REAL_TARGETS, RealConfig, run_real
    from ._real_report import format_real_table, write_real_report

    targets = args.targets if args.targets is not None else DEFAULT_REAL_TARGETS
    if args.api != ("chat",):
        print("afm bench --real-model drives chat completions only (llama.cpp's server is the "
              "peer); use --api without --real-model", file=sys.stderr)
        return 2
    bad = [t for t in targets if t not in REAL_TARGETS]
    if bad or args.url or args.rate:
        print(f"afm bench --real-model: targets are {','.join(REAL_TARGETS)} "
              f"(not {bad or '--url/--rate'})", file=sys.stderr)
        return 2
    try:
        model = resolve_model(args.model)  # what afm serve loads (the default without --model)
        gguf = args.gguf or (None if args.model else str(fetch_default_gguf()))
    except ModelLoadError as exc:
        print(f"afm bench --real-model: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out or Path("bench-results") / time.strftime("real-%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = RealConfig(
        model=str(Path(model).resolve()),
        gguf=gguf,
        out_dir=str(out_dir),
        targets=targets,
        rounds=args.rounds or 2,
        decode_tokens=args.decode_tokens,
        decode_requests=args.decode_requests,
        batch_requests=args.batch_requests,
        batch_tokens=args.batch_tokens,
        ttft_prompt_tokens=args.ttft_prompt_tokens,
        ttft_requests=args.ttft_requests,
        seed=args.seed,
        warmup=1 if args.warmup is None else args.warmup,
        request_timeout=args.request_timeout or 300.0,
        level_timeout=args.level_timeout or 600.0,
        time_budget=args.time_budget or 2400.0,
        startup_timeout=args.startup_timeout or 300.0,
        llamacpp_threads=args.llamacpp_threads,
        serve_args=tuple(args.serve_arg),
        peer_args=tuple(args.peer_arg),
        llamacpp_args=tuple(args.llamacpp_arg),
    )
    report = trio.run(run_real, cfg)
    paths = write_real_report(report, out_dir)
    print(format_real_table(report))
    for p in paths:
        print(f"wrote {p}")
    return 0 if report["phases"] and any(ph["by_target"] for ph in report["phases"]) else 1


def run(args: argparse.Namespace) -> int:
    import trio

    from ._report import format_table, write_report
    from ._run import DEFAULT_TARGETS, BenchConfig, run_bench

    if args.real_model:
        return run_real_model(args)
    if args.targets is None:
        args.targets = DEFAULT_TARGETS
    if "llamacpp" in args.targets:
        print("afm bench: the llamacpp target runs in --real-model mode only", file=sys.stderr)
        return 2
    args.warmup = 4 if args.warmup is None else args.warmup
    args.request_timeout = args.request_timeout or 120.0
    args.level_timeout = args.level_timeout or 300.0
    args.time_budget = args.time_budget or 1800.0
    args.startup_timeout = args.startup_timeout or 180.0
    args.rounds = args.rounds or 1
    if len(args.api) > 1 and not args.interleave:
        print("afm bench: several APIs run interleaved (--interleave implied)", file=sys.stderr)
        args.interleave = True

    if not args.concurrency and not args.rate:
        print("afm bench: nothing to run: give --concurrency levels or --rate", file=sys.stderr)
        return 2
    out_dir = Path(args.out or Path("bench-results") / time.strftime("bench-%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    generated = model is None
    if generated:
        from afm_core.testing import make_random_model

        model = str(make_random_model(out_dir / "tiny-model", visible_text=True))
    elif not (Path(model) / "config.json").is_file():
        print(f"afm bench: {model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    cfg = BenchConfig(
        model=str(Path(model).resolve()),
        out_dir=str(out_dir),
        targets=args.targets,
        api=args.api[0],
        apis=args.api if len(args.api) > 1 else (),
        concurrency=args.concurrency,
        requests=args.requests,
        rates=args.rate,
        open_requests=args.open_requests,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        seed=args.seed,
        warmup=args.warmup,
        request_timeout=args.request_timeout,
        level_timeout=args.level_timeout,
        time_budget=args.time_budget,
        startup_timeout=args.startup_timeout,
        max_batch=args.max_batch,
        profile=args.profile,
        interleave=args.interleave,
        rounds=args.rounds,
        url=args.url,
        url_model=args.url_model,
        serve_args=tuple(args.serve_arg),
        peer_args=tuple(args.peer_arg),
        model_was_generated=generated,
    )
    if cfg.url:
        from ._loadgen import require_loopback

        try:
            require_loopback(cfg.url)
        except ValueError as exc:
            print(f"afm bench: {exc}", file=sys.stderr)
            return 2
    report = trio.run(run_bench, cfg)
    paths = write_report(report, out_dir)
    print(format_table(report))
    for p in paths:
        print(f"wrote {p}")
    return 0 if report["levels"] else 1
