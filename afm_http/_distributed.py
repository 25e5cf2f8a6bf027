"""``afm serve --distributed tensor|pipeline``: one model over several hosts.

Every rank runs the same command line (``mlx.launch`` starts them; see
``docs/distributed.md``).  Rank 0 serves HTTP with an engine that shards the
model over the group (``EngineConfig(distributed=...)``); every other rank
loads its shard and follows rank 0's steps (``afm_core.run_follower``) with
no HTTP of its own.  :func:`add_arguments` adds the flags to ``afm serve``;
:func:`follow` runs a follower's whole life (None on rank 0 and without
``--distributed``); :func:`config_from` is rank 0's engine setting.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from ._argtypes import positive_seconds, seconds_or_zero

if TYPE_CHECKING:  # afm_core is imported when used: ``afm serve --help`` stays quick
    from afm_core import DistributedConfig

__all__ = ["add_arguments", "config_from", "follow"]


def _seconds_or_never(text: str) -> float | None:
    if text in ("never", "none"):
        return None
    try:
        return seconds_or_zero(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or 'never'") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "distributed", "one model sharded over the ranks started by mlx.launch (docs/distributed.md)")
    group.add_argument("--distributed", choices=("tensor", "pipeline"), default=None,
                       help="shard the model over the mx.distributed group: 'tensor' splits every "
                            "layer, 'pipeline' gives each rank consecutive layers; rank 0 serves "
                            "HTTP, the others follow its steps")
    group.add_argument("--distributed-backend", default="any",
                       help="MLX distributed back-end (ring, mpi, jaccl, ...; default: the "
                            "one mlx.launch set up)")
    group.add_argument("--distributed-timeout", type=positive_seconds, default=60.0, metavar="SECONDS",
                       help="a collective step waiting longer than this means a rank is hung or "
                            "gone: open streams end with an error, /health turns 503 "
                            "(default: 60; keep it above the longest prefill step)")
    group.add_argument("--distributed-heartbeat", type=positive_seconds, default=1.0, metavar="SECONDS",
                       help="idle rank 0 checks the other ranks this often (default: 1)")
    group.add_argument("--distributed-exit-after", type=_seconds_or_never, default=10.0,
                       metavar="SECONDS",
                       help="once the group is broken, exit (status 1) after this many seconds so "
                            "a supervisor restarts every rank; 'never' stays up, unhealthy "
                            "(default: 10)")


def config_from(args: argparse.Namespace) -> DistributedConfig | None:
    """Rank 0's ``EngineConfig.distributed`` from the flags (None without ``--distributed``)."""
    if not getattr(args, "distributed", None):
        return None
    from afm_core import DistributedConfig

    return DistributedConfig(mode=args.distributed, backend=args.distributed_backend,
                             timeout=args.distributed_timeout, heartbeat=args.distributed_heartbeat,
                             exit_after=args.distributed_exit_after)


def follow(args: argparse.Namespace) -> int | None:
    """On a rank other than 0: load this rank's shard, follow rank 0 until it
    stops, and return the exit status.  None on rank 0 (which goes on to serve)
    and without ``--distributed``."""
    distributed = config_from(args)
    if distributed is None:
        return None
    from afm_core import DistributedError, EngineConfig, init_distributed, run_follower

    try:
        rank, size = init_distributed(distributed.backend)
    except DistributedError as exc:
        print(f"afm: {exc}", file=sys.stderr, flush=True)
        return 1
    if rank == 0:
        print(f"afm: rank 0 of {size}: serving HTTP, {distributed.mode} parallel", file=sys.stderr, flush=True)
        return None
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s")
    config = EngineConfig(distributed=distributed, cpu_fusion=not getattr(args, "no_cpu_fusion", False))
    try:
        model = args.model[0] if isinstance(args.model, list) else args.model  # one (afm serve refuses more)
        return run_follower(model, config)
    except (DistributedError, ValueError) as exc:
        print(f"afm: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - a model that cannot load, reported like rank 0's
        print(f"afm: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
