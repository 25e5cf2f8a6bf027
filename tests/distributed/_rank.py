"""One rank of a test group: ``afm serve ... --distributed MODE`` as every rank runs it.

Rank 0 serves HTTP; the others follow.  Until ``afm_http/_serve_cli.py``
and ``afm_core/_engine/engine.py`` carry the distributed hooks (see
docs/distributed.md, "Hooks"), this script applies their equivalent: the
flags from ``afm_http._distributed``, the follower from its ``follow``, and on
rank 0 the engine's loader and worker class from ``afm_core._engine.distributed``.
"""

from __future__ import annotations

import argparse
import sys


def _serve_has_flag() -> bool:
    from afm_http import _serve_cli

    probe = argparse.ArgumentParser()
    _serve_cli.add_arguments(probe)
    return any(action.dest == "distributed" for action in probe._actions)


def main(argv: list[str]) -> int:
    from afm_core._cli import main as afm

    if _serve_has_flag():
        return afm(["serve", *argv])
    from afm_http import _distributed, _serve_cli

    parser = argparse.ArgumentParser()
    _serve_cli.add_arguments(parser)
    _distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    status = _distributed.follow(args)
    if status is not None:
        return status
    distributed = _distributed.config_from(args)
    if distributed is not None:
        import afm_core._engine.engine as engine
        import afm_core._models.loader as loader
        from afm_core._engine import distributed as dist
        from afm_core._models.sharded import load_sharded

        engine.Worker = dist.worker_factory(distributed)  # type: ignore[misc]
        loader.load = lambda path: load_sharded(path, distributed.mode, dist.init_group())
    return _serve_cli.run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
