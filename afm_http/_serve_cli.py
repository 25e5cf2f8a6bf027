"""``afm serve``: the OpenAI-compatible server on hypercorn (trio worker)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import trio


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="mlx-lm directory, .gguf file or Hugging Face repo id "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=9999)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="allow this browser origin (repeatable; '*' for any)")
    parser.add_argument("--max-body-bytes", type=int, default=8 << 20)
    parser.add_argument("--max-batch", type=int, default=32, help="streams decoded together")
    parser.add_argument("--max-waiting", type=int, default=64,
                        help="requests queued beyond --max-batch before 503")
    parser.add_argument("--prefix-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--default-max-tokens", type=int, default=None)
    parser.add_argument("--no-grammar", action="store_true", help="run strict schemas best-effort")
    parser.add_argument("--quiet", action="store_true", help="no access log")


async def _main(args: argparse.Namespace) -> None:
    from afm_core._engine import open_engine
    from afm_core._models import resolve_model

    from ._app import ServerConfig
    from ._server import serve_engine

    path = await trio.to_thread.run_sync(resolve_model, args.model)
    print(f"afm: loading {path}", file=sys.stderr, flush=True)
    server = ServerConfig(api_key=args.api_key, cors_origins=tuple(args.cors_origin),
                          max_body_bytes=args.max_body_bytes)
    done = trio.Event()

    async def shutdown_trigger() -> None:
        await done.wait()

    async with open_engine(path, max_batch=args.max_batch, max_waiting=args.max_waiting,
                           prefix_cache_bytes=args.prefix_cache_bytes,
                           default_max_tokens=args.default_max_tokens,
                           grammar=not args.no_grammar) as engine:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(lambda task_status: serve_engine(
                engine, host=args.host, port=args.port, server=server,
                shutdown_trigger=shutdown_trigger, quiet=args.quiet, task_status=task_status))
            print(f"afm: serving {engine.model_id} (context {engine.context_length} tokens) "
                  f"on {', '.join(binds)} — OpenAI API at {binds[0]}/v1", file=sys.stderr, flush=True)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    print("afm: shutting down", file=sys.stderr, flush=True)
                    done.set()
                    break


def run(args: argparse.Namespace) -> int:
    from afm_core._errors import AFMError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        trio.run(_main, args)
    except AFMError as exc:
        print(f"afm: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
