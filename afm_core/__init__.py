"""afm_core: a Trio engine over MLX with a sans-IO streaming core.

The public face; implementation modules are private (``_x``).
"""

from __future__ import annotations

from ._mlx import blas as _blas
from ._mlx import malloc as _malloc
from ._mlx import open_files as _open_files

_malloc.tune()  # large buffers go back to the system when freed: see afm_core._mlx.malloc
_blas.ensure_loaded()  # before anything computes with MLX: see afm_core._mlx.blas
_open_files.import_mlx_lm()  # before anything else imports mlx-lm: it would lower the open-file limit

from ._engine.chat_stream import ChatStream as ChatStream
from ._engine.chat_stream import Embeddings as Embeddings
from ._engine.commands import PromptLogprobs as PromptLogprobs
from ._engine.config import DistributedConfig as DistributedConfig
from ._engine.config import EngineConfig as EngineConfig
from ._engine.distributed import init_distributed as init_distributed
from ._engine.distributed import run_follower as run_follower
from ._engine.engine import Engine as Engine
from ._engine.engine import open_engine as open_engine
from ._engine.runtime import RuntimeInfo as RuntimeInfo
from ._engine.runtime import runtime_info as runtime_info
from ._engine.stats import EngineStatistics as EngineStatistics
from ._errors import AdapterNotFoundError as AdapterNotFoundError
from ._errors import AFMError as AFMError
from ._errors import ContextLengthError as ContextLengthError
from ._errors import DistributedError as DistributedError
from ._errors import DuplicateRequestError as DuplicateRequestError
from ._errors import EngineBusyError as EngineBusyError
from ._errors import EngineClosedError as EngineClosedError
from ._errors import GenerationError as GenerationError
from ._errors import GGUFError as GGUFError
from ._errors import ModelLoadError as ModelLoadError
from ._errors import RequestError as RequestError
from ._errors import StreamErrorChunk as StreamErrorChunk
from ._errors import StreamProtocolError as StreamProtocolError
from ._errors import UnsupportedError as UnsupportedError
from ._models import architectures as _architectures
from ._models.gguf.convert import convert_gguf as convert_gguf
from ._models.resolve import resolve_model as resolve_model
from ._models.stores import LocalModel as LocalModel
from ._models.stores import find_local_model as find_local_model
from ._models.stores import local_models as local_models
from ._stream.accumulate import ChunkAccumulator as ChunkAccumulator
from ._stream.accumulate import accumulate as accumulate
from ._stream.detok import DecoderTables as DecoderTables
from ._stream.detok import IncrementalDetokenizer as IncrementalDetokenizer
from ._stream.events import ContentDelta as ContentDelta
from ._stream.events import Finish as Finish
from ._stream.events import LogprobsDelta as LogprobsDelta
from ._stream.events import Profile as Profile
from ._stream.events import PromptProgress as PromptProgress
from ._stream.events import ReasoningDelta as ReasoningDelta
from ._stream.events import StreamError as StreamError
from ._stream.events import StreamFailure as StreamFailure
from ._stream.events import TokenLogprob as TokenLogprob
from ._stream.events import ToolCallDelta as ToolCallDelta
from ._stream.events import TopLogprob as TopLogprob
from ._stream.events import Usage as Usage
from ._stream.reasoning import ReasoningSplitter as ReasoningSplitter
from ._stream.sse import SSEEncoder as SSEEncoder
from ._stream.structured import StructuredOutput as StructuredOutput
from ._stream.structured import StructuredResult as StructuredResult
from ._stream.structured import make_structured_output as make_structured_output
from ._stream.toolcalls.base import ToolCallError as ToolCallError
from ._stream.toolcalls.base import ToolCallFailure as ToolCallFailure
from ._stream.toolcalls.registry import guess_tool_format as guess_tool_format
from ._stream.toolcalls.registry import make_tool_tracker as make_tool_tracker
from ._stream.tools import ToolCallTracker as ToolCallTracker
from .api.chat_request import ChatRequest as ChatRequest
from .api.completions_request import CompletionRequest as CompletionRequest

_architectures.register()

__version__ = "0.1.0"

__all__ = [
    "AFMError",
    "AdapterNotFoundError",
    "ChatRequest",
    "ChatStream",
    "ChunkAccumulator",
    "CompletionRequest",
    "ContentDelta",
    "ContextLengthError",
    "DecoderTables",
    "DistributedConfig",
    "DistributedError",
    "DuplicateRequestError",
    "Embeddings",
    "Engine",
    "EngineBusyError",
    "EngineClosedError",
    "EngineConfig",
    "EngineStatistics",
    "Finish",
    "GGUFError",
    "GenerationError",
    "IncrementalDetokenizer",
    "LocalModel",
    "LogprobsDelta",
    "ModelLoadError",
    "Profile",
    "PromptLogprobs",
    "PromptProgress",
    "ReasoningDelta",
    "ReasoningSplitter",
    "RequestError",
    "RuntimeInfo",
    "SSEEncoder",
    "StreamError",
    "StreamErrorChunk",
    "StreamFailure",
    "StreamProtocolError",
    "StructuredOutput",
    "StructuredResult",
    "TokenLogprob",
    "ToolCallDelta",
    "ToolCallError",
    "ToolCallFailure",
    "ToolCallTracker",
    "TopLogprob",
    "UnsupportedError",
    "Usage",
    "__version__",
    "accumulate",
    "convert_gguf",
    "find_local_model",
    "guess_tool_format",
    "init_distributed",
    "local_models",
    "make_structured_output",
    "make_tool_tracker",
    "open_engine",
    "resolve_model",
    "run_follower",
    "runtime_info",
]
