"""The one record the generation thread hands Trio when it starts.

Starting the thread (``Engine.run``) yields a :data:`StartUp`: the
:class:`~.worker.Worker` with the tokenizer and model it loaded, or the error
that stopped it.  It lives apart from :mod:`.commands` because it holds the
worker, which is built on those records: the worker sits above the commands,
and this record above the worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .._models.loader import ModelInfo
    from .._stream.detok import DecoderTables
    from .worker import Worker

__all__ = ["StartFailed", "StartUp", "Started"]


@dataclass(frozen=True, slots=True)
class Started:
    """The generation thread loaded the model and is about to run its loop."""

    worker: Worker
    tokenizer: TokenizerWrapper
    tables: DecoderTables
    info: ModelInfo


@dataclass(frozen=True, slots=True)
class StartFailed:
    """Loading the model or creating the MLX objects raised ``error``; the
    thread has returned."""

    error: BaseException


StartUp: TypeAlias = Started | StartFailed
