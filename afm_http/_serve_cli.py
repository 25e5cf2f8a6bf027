"""``afm serve``: the OpenAI-compatible server on hypercorn (trio worker).

The engine and the server share one ``trio.run``; Ctrl-C or SIGTERM stops
listening, cancels open requests (their streams end ``cancelled`` then
``[DONE]``), and closes the engine.  With ``--drain-timeout S`` above 0,
SIGTERM drains first (``/health`` 503, new generation requests 503, running
streams get up to S seconds: :mod:`afm_http._drain`); Ctrl-C, or a second
signal, still stops at once.

``--model`` given more than once, or ``--models-dir DIR``, serves several
models from one process (:mod:`afm_http._registry`): a request's ``model``
picks one (the first is the default), each loads on first use and unloads
once idle for ``--keep-alive`` (or the request's ``keep_alive``), or when
``--max-loaded-bytes`` needs room.  With one model nothing changes: it is
loaded before the server listens and kept.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from afm_core import EngineConfig

from . import _distributed
from ._argtypes import (
    byte_count,
    int_at_least,
    int_or_auto,
    port,
    positive_seconds,
    seconds_or_zero,
)
from ._residency import FOREVER, parse_keep_alive
from ._state import ServerConfig

if TYPE_CHECKING:
    from afm_core import Engine

    from ._registry import ModelSpec

_ENGINE = EngineConfig()
"""``EngineConfig``'s field defaults: the engine flags' defaults are read here, declared once."""
_SERVER = ServerConfig()
"""``ServerConfig``'s defaults: the HTTP flags' defaults, declared once."""

DEFAULT_KEEP_ALIVE = 300.0
"""How long an idle model stays loaded when several are served (Ollama's 5 minutes)."""


def _keep_alive(text: str) -> float:
    try:
        return parse_keep_alive(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``afm serve``'s flags: the models, the server, the engine (its defaults
    from :class:`EngineConfig` and :class:`ServerConfig`), speculative decoding,
    the distributed group."""
    _model_arguments(parser)
    _server_arguments(parser)
    engine = parser.add_argument_group("engine")
    _engine_arguments(engine)
    _spec_arguments(parser)
    _feature_arguments(engine)
    parser.add_argument("--quiet", action="store_true", help="no access log")
    _distributed.add_arguments(parser)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    """Which models are served, and how long they stay loaded."""
    parser.add_argument("--model", action="append", default=None, metavar="M",
                        help="mlx-lm directory, .gguf file or Hugging Face repo id "
                             "(default: the embedded SmolLM2-135M-Instruct); repeat it to serve "
                             "several models, chosen by each request's 'model' (the first is the "
                             "default), each loaded on first use")
    parser.add_argument("--models-dir", default=None, metavar="DIR",
                        help="also serve every model in DIR (its mlx-lm model subdirectories and "
                             ".gguf files, by name), each loaded on first use")
    parser.add_argument("--keep-alive", type=_keep_alive, default=None, metavar="DURATION",
                        help="how long a model stays loaded once its last request ended, in seconds "
                             "or as '5m', '1h'; 0: unload at once, negative: never (a request's "
                             "'keep_alive' overrides it, as Ollama's; default: 5m with several "
                             "models, never with one)")
    parser.add_argument("--max-loaded-bytes", type=byte_count, default=None, metavar="N",
                        help="budget for the loaded models' weights (bytes on disk; e.g. 8G): "
                             "loading one first unloads the least recently used idle ones, or "
                             "waits for one to become idle (default: no budget)")


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP server: address, access, limits, timeouts, the chat page, draining."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address (default: 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=port, default=9999, help="TCP port (0: any free port)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health and "
                             "the chat page's own files (the page sends the key it is given)")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="allow this browser origin (repeatable; '*' for any; default: CORS off)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="without --api-key, also accept requests whose Host header is NAME "
                             "(besides IP addresses, localhost and --host; repeatable; '*' for any): "
                             "other names are refused, against DNS rebinding (default: none)")
    parser.add_argument("--max-body-bytes", type=int_at_least(1), default=_SERVER.max_body_bytes,
                        help="larger request bodies get 413 (default: 8 MiB)")
    parser.add_argument("--responses-store-size", type=int_at_least(0), default=_SERVER.responses_store_size,
                        metavar="N",
                        help="finished Responses API responses kept in memory for GET and "
                             "previous_response_id; the oldest is evicted (0: none; default: 1000)")
    parser.add_argument("--responses-store-bytes", type=byte_count, default=_SERVER.responses_store_bytes,
                        metavar="N",
                        help="bytes (of their JSON) the stored Responses API responses may hold "
                             "together; the oldest are evicted (default: 128M)")
    parser.add_argument("--responses-store-ttl", type=positive_seconds, default=_SERVER.responses_store_ttl,
                        metavar="SECONDS",
                        help="how long a stored Responses API response is kept (default: 3600)")
    parser.add_argument("--keepalive-seconds", type=seconds_or_zero, default=_SERVER.keepalive_seconds,
                        metavar="S",
                        help="a streaming response silent this long (queued or prefilling) gets "
                             "an SSE comment ': keepalive' (Anthropic's route: a ping event, the "
                             "Responses route: response.in_progress again); "
                             "0: none (default: 10)")
    parser.add_argument("--stream-write-timeout", type=seconds_or_zero, default=_SERVER.stream_write_timeout, metavar="S",
                        help="close a connection whose client has taken none of a response's bytes "
                             "for S seconds (it stopped reading): its request is cancelled and its "
                             "slot freed; 0: wait forever (default: 30)")
    parser.add_argument("--idle-timeout", type=positive_seconds, default=_SERVER.idle_timeout, metavar="S",
                        help="close a connection without a request in progress (between requests, "
                             "or still sending its headers) after S seconds (default: 30)")
    parser.add_argument("--max-connections", type=int_at_least(1), default=_SERVER.max_connections, metavar="N",
                        help="open connections at most (lowered to fit the open-file limit, which "
                             "afm raises at start); at the cap a new connection closes the longest "
                             "idle one (default: 1024)")
    parser.add_argument("--no-ui", action="store_true",
                        help="do not serve the chat page at / (then 404)")
    parser.add_argument("--drain-timeout", type=seconds_or_zero, default=_SERVER.drain_timeout, metavar="S",
                        help="on SIGTERM (or POST /admin/drain), report not ready and refuse new "
                             "generation requests at once, let running streams finish for up to S "
                             "seconds, then cancel the rest; 0: SIGTERM cancels open streams at "
                             "once (default: 0; behind a load balancer use e.g. 30)")


def _engine_arguments(engine: argparse._ArgumentGroup) -> None:
    """The batch, the prefill, the prefix cache and the KV cache."""
    engine.add_argument("--max-batch", type=int_at_least(1), default=_ENGINE.max_batch,
                        help="streams decoded together (default: 32)")
    engine.add_argument("--max-waiting", type=int_at_least(0), default=_ENGINE.max_waiting,
                        help="requests queued beyond --max-batch before 503 (default: 64)")
    engine.add_argument("--prefill-batch", type=int_at_least(1), default=_ENGINE.prefill_batch,
                        help="prompts prefilled together (default: 8)")
    engine.add_argument("--prefill-step", type=int_at_least(1), default=_ENGINE.prefill_step,
                        help="prompt tokens per prefill step (default: 2048)")
    engine.add_argument("--prefill-step-decoding", type=int_at_least(0), default=_ENGINE.prefill_step_decoding, metavar="N",
                        help="while other streams decode, prompt tokens per prefill step, counted at "
                             "their cost at a prompt's start (later chunks of a long prompt hold fewer): "
                             "bounds how long a long prompt pauses the running streams; 0: always "
                             "--prefill-step (default: 256)")
    engine.add_argument("--prefix-cache-bytes", type=int_at_least(0), default=_ENGINE.prefix_cache_bytes,
                        help="prompt prefix cache budget, 0 disables it (default: the KV cache of one "
                             "request filling the model's context, at most 1 GiB)")
    engine.add_argument("--cache-dir", default=_ENGINE.cache_dir, metavar="DIR",
                        help="keep the prefix cache on disk too, in DIR (created if missing): every "
                             "finished request's cache is written there in the background, read back "
                             "when memory no longer holds it, and found again after a restart "
                             "(one directory per server; not with --distributed; default: memory only)")
    engine.add_argument("--cache-disk-bytes", type=int_at_least(0), default=_ENGINE.cache_disk_bytes, metavar="N",
                        help="bytes --cache-dir may use; the least recently used entries are deleted "
                             "beyond (default: 8 GiB)")
    engine.add_argument("--kv-bits", type=int, choices=(4, 8), default=_ENGINE.kv_bits, metavar="{4,8}",
                        help="quantize the KV cache to 8 or 4 bits per element from the first token "
                             "(mlx-lm's QuantizedKVCache, batched): 28%% (8) or 16%% (4) of float32's KV "
                             "bytes per token, for greedy output that can drift from float's; "
                             "--cache-dir entries are kept per setting "
                             "(not with --distributed; default: float)")
    engine.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=_ENGINE.kv_group_size, metavar="{32,64,128}",
                        help="elements per scale and bias of the quantized KV cache; must divide the "
                             "model's head size (default: 64)")
    engine.add_argument("--kv-dtype", choices=("auto", "float16", "model"), default=_ENGINE.kv_dtype,
                        help="the float KV cache's element type: float16 (half of float32's bytes), "
                             "model (the type the model computes in), auto: float16 where the model "
                             "computes in float32 and its keys and values fit (default: auto)")
    engine.add_argument("--default-max-tokens", type=int_at_least(1), default=_ENGINE.default_max_tokens,
                        help="cap for requests without max_tokens (default: the rest of the context)")


def _spec_arguments(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding."""
    spec = parser.add_argument_group("speculative decoding (greedy requests get the same tokens, sampled "
                                     "ones the same distribution; grammar, penalties, logit_bias and "
                                     "logprobs apply at every checked position)")
    spec.add_argument("--prompt-lookup", type=int_or_auto(0), default=_ENGINE.prompt_lookup, metavar="N",
                      help="propose up to N tokens per step from an earlier occurrence of the stream's last "
                           "tokens in its prompt or output, checked by one forward pass (0: off; default: "
                           "auto: for a model of 256 MiB of weights or more 4 with the VNNI kernels, 2 "
                           "with the others (AVX2, portable), where it paid on chat and code editing "
                           "alike; else off)")
    spec.add_argument("--draft-model", default=_ENGINE.draft_model, metavar="M",
                      help="a smaller model with the same tokenizer proposes the tokens instead (an mlx-lm "
                           "directory, a .gguf or a hub id; default: none)")
    spec.add_argument("--draft-tokens", type=int_at_least(1), default=_ENGINE.draft_tokens, metavar="K",
                      help="tokens the draft model proposes per step (default: 4)")
    spec.add_argument("--spec-max-batch", type=int_at_least(0), default=_ENGINE.spec_max_batch, metavar="N",
                      help="speculate only while at most N streams decode; more run the plain batched "
                           "step (decided before every step; 0: never; default: 1)")


def _feature_arguments(engine: argparse._ArgumentGroup) -> None:
    """The engine's optional behaviours: prompts, grammars, warm-up, kernels, adapters, embeddings."""
    engine.add_argument("--keep-volatile-lines", action="store_true",
                        help="keep the per-request lines clients put into system prompts (Claude Code's "
                             "x-anthropic-billing-header); by default they are taken out so sessions "
                             "share their prefix in the prefix cache")
    engine.add_argument("--no-grammar", action="store_true",
                        help="run strict JSON schemas best-effort (X-Grammar-Constraints: downgraded)")
    engine.add_argument("--no-enforce-json-modes", action="store_true",
                        help="generate json_object and non-strict json_schema unconstrained, only "
                             "sanitizing the answer (default: enforced by the grammar, best-effort)")
    engine.add_argument("--no-warmup", action="store_true",
                        help="report ready without running the start-up warm-up requests "
                             "(the first request then pays one-time costs)")
    engine.add_argument("--no-cpu-fusion", action="store_true",
                        help="on MLX's CPU backend, keep mlx-lm's own norm, rotary and linear layers")
    engine.add_argument("--adapter", action="append", type=_adapter, default=[], metavar="[MODEL:]NAME=PATH",
                        help="serve the LoRA adapter in the mlx-lm adapter directory PATH (as mlx_lm.lora "
                             "writes it) as NAME on the first --model (or on MODEL); a request picks it "
                             "with model \"MODEL_ID:NAME\" or \"adapters\": \"NAME\"; repeatable. Rows on "
                             "different adapters decode in one batch")
    engine.add_argument("--embedding-pooling", choices=("mean", "last", "cls"), default=_ENGINE.embedding_pooling,
                        help="how /v1/embeddings pools the final hidden states (L2-normalized)")
    engine.add_argument("--embedding-step", type=int_at_least(1), default=_ENGINE.embedding_step, metavar="N",
                        help="tokens of /v1/embeddings work computed between two decode steps, at most "
                             "(a long input in slices): running streams pause at most that long "
                             "(default: 512)")
    engine.add_argument("--prepare-timeout", type=positive_seconds, default=_ENGINE.prepare_timeout, metavar="S",
                        help="a request whose templating, tokenizing and grammar take longer than S "
                             "seconds gets 503 prepare_timeout (default: 60)")
    engine.add_argument("--embedding-model", default=None, metavar="M",
                        help="answer /v1/embeddings with this model (an mlx-lm directory, a .gguf "
                             "or a hub id, e.g. a Qwen3-Embedding conversion with "
                             "--embedding-pooling last) on its own generation thread; default: "
                             "the served model")


def describe_blas(blas: Mapping[str, Any]) -> str:
    """One line for the start-up log from ``RuntimeInfo.blas``, e.g.
    ``openblas (OpenBLAS 0.3.34 ..., 2 threads)`` or ``reference (why)``."""
    name = blas.get("name")
    if name == "openblas":
        return f"openblas ({blas.get('detail', '')}, {blas.get('threads')} threads)"
    reason = blas.get("reason")
    return f"{name} ({reason})" if reason else f"{name}"


def _say(message: str) -> None:
    print(f"afm: {message}", file=sys.stderr, flush=True)


def _adapter(text: str) -> tuple[str | None, str, str]:
    """``[MODEL:]NAME=PATH`` as (model or None, name, path)."""
    head, eq, path = text.partition("=")
    model, colon, name = head.rpartition(":")
    if not eq or not name or not path or (colon and not model):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH or MODEL:NAME=PATH")
    return (model or None), name, str(Path(path).expanduser())


def _several(args: argparse.Namespace) -> bool:
    return len(args.model or ()) > 1 or args.models_dir is not None


async def _model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """The served models: each ``--model`` (the default model, when named so or
    when none is given, is fetched now), then ``--models-dir``'s."""
    from afm_core import ModelLoadError, resolve_model

    from ._registry import model_spec, models_in_dir

    values = args.model or ([] if args.models_dir else [None])
    specs = []
    for value in values:
        named = value
        if value is None or value.strip() in ("", "default") or not _several(args):
            # one model is resolved (fetched, converted) before serving, as it always was
            value = await trio.to_thread.run_sync(resolve_model, value)
        specs.append(model_spec(value, named=named))
    if args.models_dir is not None:
        found = models_in_dir(args.models_dir)
        if not found:
            raise ModelLoadError(f"--models-dir {args.models_dir}: no mlx-lm model directory or "
                                 ".gguf file in it")
        specs += found
    ids = [s.id for s in specs]
    if len(set(ids)) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise ModelLoadError(f"two models have the same id ({', '.join(twice)}): a request's "
                             "'model' could not tell them apart; rename one")
    for model, name, path in args.adapter:
        at = 0 if model is None else ids.index(model) if model in ids else -1
        if at < 0:
            raise ModelLoadError(f"--adapter {model}:{name}: no served model has the id {model!r}")
        spec = specs[at]
        specs[at] = replace(spec, adapters=(*spec.adapters, (name, path)))
    return specs


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    from afm_core import EngineConfig

    return EngineConfig(max_batch=args.max_batch, max_waiting=args.max_waiting,
                        prefill_batch=args.prefill_batch, prefill_step=args.prefill_step,
                        prefill_step_decoding=args.prefill_step_decoding,
                        prefix_cache_bytes=args.prefix_cache_bytes,
                        cache_dir=args.cache_dir, cache_disk_bytes=args.cache_disk_bytes,
                        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, kv_dtype=args.kv_dtype,
                        default_max_tokens=args.default_max_tokens,
                        grammar=not args.no_grammar,
                        keep_volatile_lines=args.keep_volatile_lines,
                        enforce_json_modes=not args.no_enforce_json_modes,
                        warmup=not args.no_warmup,
                        cpu_fusion=not args.no_cpu_fusion,
                        embedding_pooling=args.embedding_pooling,
                        embedding_step=args.embedding_step, prepare_timeout=args.prepare_timeout,
                        prompt_lookup=args.prompt_lookup, draft_model=args.draft_model,
                        draft_tokens=args.draft_tokens, spec_max_batch=args.spec_max_batch,
                        distributed=_distributed.config_from(args))


def _duration(seconds: float) -> str:
    return "never" if seconds == FOREVER else f"{seconds:g} s"


async def _main(args: argparse.Namespace) -> None:
    from afm_core import resolve_model

    from ._registry import open_models
    from ._server import serve_engine

    specs = await _model_specs(args)
    several = _several(args)
    keep_alive = args.keep_alive if args.keep_alive is not None \
        else DEFAULT_KEEP_ALIVE if several else FOREVER
    if several:
        _say(f"{len(specs)} models, each loaded on first use (keep-alive {_duration(keep_alive)}"
             + (f", at most {args.max_loaded_bytes} bytes of weights loaded" if args.max_loaded_bytes
                else "") + "): " + ", ".join(s.id for s in specs))
    else:
        _say(f"loading {specs[0].source}")
    embedding_path = None
    if args.embedding_model is not None:
        embedding_path = await trio.to_thread.run_sync(resolve_model, args.embedding_model)
        _say(f"loading the embedding model {embedding_path}")
    server = _server_config(args)
    stop = trio.Event()
    drain = trio.Event()

    async with open_models(specs, config=_engine_config(args), keep_alive=keep_alive,
                           max_loaded_bytes=args.max_loaded_bytes, strict=several,
                           pinned=not several and args.keep_alive is None,
                           preload=() if several else (specs[0].id,)) as models, \
            _embedding_engine(embedding_path, args) as embedder:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
                    await serve_engine(models, host=args.host, port=args.port, server=server,
                                       shutdown_trigger=stop.wait, drain_trigger=drain.wait,
                                       quiet=args.quiet, embedder=embedder, task_status=task_status)
                    nursery.cancel_scope.cancel()  # (after a drain) stop waiting for signals

                binds = await nursery.start(serve)
                engine = models.engine_of(models.default_id)
                what = f"{engine.model_id} (context {engine.context_length} tokens)" \
                    if engine is not None and not several else f"{len(specs)} models"
                _say_serving(args, what, binds, embedder)
                await _until_stopped(signals, args, drain=drain, stop=stop)


def _server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(api_key=args.api_key, cors_origins=tuple(args.cors_origin),
                        allowed_hosts=tuple(args.allowed_host),
                        max_body_bytes=args.max_body_bytes,
                        responses_store_size=args.responses_store_size,
                        responses_store_ttl=args.responses_store_ttl,
                        responses_store_bytes=args.responses_store_bytes,
                        stream_write_timeout=args.stream_write_timeout,
                        idle_timeout=args.idle_timeout, max_connections=args.max_connections,
                        keepalive_seconds=args.keepalive_seconds,
                        drain_timeout=args.drain_timeout, ui=not args.no_ui)


def _say_serving(args: argparse.Namespace, what: str, binds: list[str], embedder: Engine | None) -> None:
    """The start-up lines once the server listens: the kernels, the addresses, the embedder."""
    from afm_core import runtime_info

    info = runtime_info()
    isa = info.quantized_kernel
    _say(f"BLAS: {describe_blas(info.blas)}; quantized products: "
         f"{'afm kernel (' + isa + ')' if isa else 'MLX kernel'}")
    auth = ", API key required" if args.api_key else ""
    _say(f"serving {what} on {', '.join(binds)}; OpenAI API at {binds[0]}/v1{auth}"
         + ("" if args.no_ui else f"; chat page at {binds[0]}/"))
    if embedder is not None:
        _say(f"embeddings from {embedder.model_id} ({args.embedding_pooling} pooling)")


async def _until_stopped(signals: AsyncIterator[int], args: argparse.Namespace, *, drain: trio.Event,
                         stop: trio.Event) -> None:
    """SIGTERM with a drain timeout drains first; any other (or a second) signal stops."""
    async for signum in signals:
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM and args.drain_timeout > 0 and not drain.is_set():
            _say(f"{name}: draining (open streams get up to {args.drain_timeout:g} s; "
                 "a second signal stops at once)")
            drain.set()
            continue
        _say(f"{name}: shutting down")
        stop.set()
        break


@asynccontextmanager
async def _embedding_engine(path: Path | None, args: argparse.Namespace) -> AsyncIterator[Engine | None]:
    """The ``--embedding-model`` engine (no warm-up, prefix cache or grammar:
    it only embeds), or None."""
    if path is None:
        yield None
        return
    from afm_core import open_engine

    async with open_engine(path, max_batch=args.max_batch, max_waiting=args.max_waiting,
                           prefill_step=args.prefill_step, prefix_cache_bytes=0, grammar=False,
                           warmup=False, cpu_fusion=not args.no_cpu_fusion,
                           embedding_pooling=args.embedding_pooling, embedding_step=args.embedding_step,
                           prepare_timeout=args.prepare_timeout) as engine:
        yield engine


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 on a clean shutdown, 1 when the server cannot start."""
    from afm_core import AFMError

    if args.distributed is not None and _several(args):
        _say("--distributed serves one model over several hosts: give one --model (no "
             "--models-dir); run another afm serve for each other model")
        return 1
    if args.cache_dir is not None and args.distributed is not None:
        _say("--cache-dir cannot be used with --distributed: each rank holds only its shard of "
             "every cached prefix (the memory tier works on every rank)")
        return 1
    if args.kv_bits is not None and args.distributed is not None:
        _say("--kv-bits cannot be used with --distributed: the sharded model's ranks keep float "
             "KV caches of their own")
        return 1
    if (status := _distributed.follow(args)) is not None:
        return status  # a rank other than 0 of --distributed: it followed rank 0's steps
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from ._connections import raise_open_file_limit

    raise_open_file_limit()  # idle connections must never run the process out of descriptors
    status = 0
    try:
        trio.run(_main, args)
    except* AFMError as group:
        _say(str(_leaf(group)))
        status = 1
    except* OSError as group:
        _say(f"cannot listen on {args.host}:{args.port}: {_leaf(group)}")
        status = 1
    except* KeyboardInterrupt:
        pass
    return status
