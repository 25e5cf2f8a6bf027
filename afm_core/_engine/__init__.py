"""The engine: the Trio face, request preparation, and the generation thread.

Owns: :class:`~.engine.Engine` / :func:`~.engine.open_engine` (the only
Trio-aware core code), turning a validated request into a generation job
(:mod:`.prepare`), the per-stream mailbox that hands each step's events to
Trio (:mod:`.mailbox`), the generation thread that owns MLX and mlx-lm's
continuous batcher (:mod:`.genthread`, :mod:`.worker`), the commands and
per-request records that cross between the two threads (:mod:`.commands`),
sampling, grammar masks and profile recording, and one model sharded over
several hosts (:mod:`.distributed`: rank 0's worker journals and broadcasts
its batch operations, the other ranks follow).

May import: :mod:`afm_core._stream`, :mod:`afm_core._models`,
:mod:`afm_core._mlx`, :mod:`afm_core._errors`, trio, mlx and mlx-lm's public
functions.  Reaching into mlx-lm's private fields belongs in ``_mlx``.
Nothing below imports this package.
"""
