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
    afm bench --real-model                      # default model: afm (best and AVX2 kernels)
                                                # vs llama.cpp's batching server (xllamacpp)
    afm bench --real-model --models all         # + Qwen2.5-Coder 0.5B/1.5B, Gemma-3-270M
    afm bench --real-model --gguf FILE.gguf --ttft-lengths 512,4096 --rounds 1
    afm bench --speculation                     # Qwen2.5-Coder-1.5B: draft 0.5B / prompt lookup
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ._apis import APIS
from ._real_cli import _ints


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
    from ._real_targets import REAL_TARGETS
    from ._run import ALL_TARGETS
    from ._spec import SPEC_TARGETS

    known = tuple(dict.fromkeys(ALL_TARGETS + REAL_TARGETS + SPEC_TARGETS))
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
           "(mlx_lm.server), ours (afm serve); with --real-model also ours_avx2, llamacpp, "
           "llamacpp_py; with --speculation ours, ours_lookup, ours_draft, llamacpp, "
           "llamacpp_draft; default " + ",".join(DEFAULT_TARGETS)
           + " (--real-model: ours,ours_avx2,llamacpp; --speculation: all five)")
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
      help="seconds per request (default 120; --real-model: from the phase's work)")
    a("--level-timeout", type=float, default=None,
      help="seconds per level per target (default 300; --real-model: from the requests')")
    a("--time-budget", type=float, default=None,
      help="seconds for the whole run (default 1800; --real-model: 4x the estimate, >= 2400)")
    a("--startup-timeout", type=float, default=None,
      help="seconds for a server to be healthy (default 180; --real-model 600: a conversion)")
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
    from ._real_cli import add_real_arguments

    add_real_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import trio

    from ._report import format_table, write_report
    from ._run import ALL_TARGETS, DEFAULT_TARGETS, BenchConfig, run_bench

    if args.real_model or args.speculation:
        from ._real_cli import run_real_mode

        return run_real_mode(args)
    if args.targets is None:
        args.targets = DEFAULT_TARGETS
    if any(t not in ALL_TARGETS for t in args.targets):
        print("afm bench: the llamacpp, ours_avx2 and speculation targets run in --real-model or "
              "--speculation mode only", file=sys.stderr)
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
