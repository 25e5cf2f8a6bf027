"""What passes between the engine's Trio face and its generation thread.

The Trio side (:class:`~.engine.Engine`) and the generation thread
(:class:`~.worker.Worker`) share nothing but the records here.  Trio sends
one :data:`Command` per action down the thread's queue (:class:`Submit`,
:class:`Cancel`, :class:`Drop`, :class:`Stop`, :class:`Reset`,
:class:`Sync`, :class:`Embed`); the thread answers with one :data:`Outputs`
per engine step.
A :class:`Job` is built off both threads (:mod:`.prepare`), travels in a
:class:`Submit` and belongs to the generation thread from then on.  The Trio
side follows each request with a :class:`RequestRecord` whose
:class:`RequestState` says where it stands.  Starting the thread yields one
:data:`~.startup.StartUp` record (:mod:`.startup`: it holds the worker, so
it lives above :mod:`.worker`, which builds on the records here).

Three id spaces
---------------
``request_id`` (:data:`RequestId`, ``str``)
    The client's name for a request: the HTTP ``X-Request-ID`` header, the
    ``request_id=`` argument of :meth:`Engine.stream <.engine.Engine.stream>`,
    or a generated ``req_<hex>``.  Unique among the requests in flight (a
    duplicate is refused), reusable once a request has ended; what
    :meth:`Engine.cancel <.engine.Engine.cancel>` takes and replicas are
    routed by.  Trio side only (``InFlight.by_id``, :mod:`.inflight`): it never reaches the
    generation thread.
``key`` (:data:`JobKey`, ``int``)
    The engine's serial number for one submission, given by ``Engine.stream``
    and never reused within an engine, so a late event for an ended request
    cannot reach a new request that took its ``request_id``.  The only id that
    crosses the thread boundary: commands name jobs by key and :data:`Outputs`
    are keyed by it (``InFlight.by_key``, ``Worker.by_key``).
``uid`` (:data:`MlxUid`, ``int``)
    mlx-lm's ``BatchGenerator`` uid, given when the generation thread admits
    the job into the batch (``None`` before).  mlx-lm's responses carry it;
    generation thread only (``Worker.by_uid``, ``Worker.logprob_uids``).

(A response's ``id``, ``chatcmpl-<hex>``, names the output only; the engine
never looks anything up by it.)
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, NewType, TypeAlias

from .._stream.events import Event, TopLogprob
from .._stream.pipeline import StreamPipeline
from ..api.chat_request import ChatRequest
from ..api.completions_request import CompletionRequest
from .mailbox import Mailbox
from .profile import ProfileRecorder

if TYPE_CHECKING:
    from .._mlx.prefill import PromptScores
    from .grammar import GrammarProcessor
    from .sampling import GuardedProcessor

__all__ = [
    "Cancel",
    "Command",
    "Delivery",
    "Drop",
    "Embed",
    "Job",
    "JobKey",
    "MlxUid",
    "Outputs",
    "PromptLogprobs",
    "RequestId",
    "RequestRecord",
    "RequestState",
    "Reset",
    "Stop",
    "Submit",
    "Sync",
]

RequestId: TypeAlias = str
"""The client's id of a request (see the module docstring)."""
JobKey = NewType("JobKey", int)
"""The engine's serial number of one submission (see the module docstring)."""
MlxUid = NewType("MlxUid", int)
"""mlx-lm's ``BatchGenerator`` uid of an admitted job (see the module docstring)."""


# -- the job ------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Job:
    """One request as the generation thread sees it.

    Built by :func:`~.prepare.build_job`; after :class:`Submit` only the
    generation thread touches it.
    """

    key: JobKey
    request: ChatRequest | CompletionRequest
    prompt: list[int]
    """The rendered prompt's token ids."""
    max_tokens: int
    """Tokens to generate at most (the request's ``max_tokens`` or the default
    budget); 0 only for a completion, which then generates nothing."""
    pipeline: StreamPipeline
    profile: ProfileRecorder | None = None
    grammar: GrammarProcessor | None = None
    """The logits processor enforcing the output's grammar, if any."""
    stop_at_eos: bool = True
    """End at the model's end-of-sequence tokens (False: a completion's ``ignore_eos``)."""
    prompt_top_logprobs: int | None = None
    """Score the prompt's own tokens with this many alternatives per position
    (a completion's ``prompt_logprobs``); None: do not."""
    progress: bool = False
    """Send :class:`~afm_core._stream.events.PromptProgress` events while the
    prompt is prefilled (``Engine.stream(..., progress=True)``)."""
    adapter: int = 0
    """The LoRA adapter the job runs with: an index into ``EngineConfig.adapters``
    plus one (0: none)."""
    breakpoints: tuple[tuple[int, float], ...] = ()
    """The request's cache breakpoints as ``(prompt tokens, ttl seconds)``: those
    prefixes of the prompt are pinned in the prefix cache when the job's entry is
    saved, and usage counts what they newly write (``Usage.cache_write_tokens``)."""
    # filled in by the generation thread
    uid: MlxUid | None = None
    """Given when the job is admitted into mlx-lm's batch."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    completion_tokens: int = 0
    guards: list[GuardedProcessor] = field(default_factory=list)
    """The job's logits processors, each recording (not raising) its failure."""
    scores: PromptScores | None = None
    """The prompt being scored during prefill, until the first token arrives."""
    t_admitted: float = 0.0
    """``time.perf_counter()`` when the generation thread took the job in (0: not yet)."""
    leader: Job | None = None
    """While parked: the job prefilling the same prompt, whose prefilled
    cache this one starts from (it has no ``uid`` until then)."""
    followers: list[Job] = field(default_factory=list)
    """The jobs parked on this one (see :attr:`leader`), until its prefill ends."""


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A prompt's own tokens scored by the model (a request with ``prompt_logprobs``).

    One entry per prompt token: ``tokens[i]`` is the text of ``ids[i]``
    (decoded alone), ``logprobs[i]`` its log-probability given the tokens
    before it (``None`` for the first token, which has no context), and
    ``top_logprobs[i]`` the most likely tokens at that position, best first
    (as many as asked; empty for the first token).
    """

    ids: tuple[int, ...]
    tokens: tuple[str, ...]
    logprobs: tuple[float | None, ...]
    top_logprobs: tuple[tuple[TopLogprob, ...], ...]


# -- commands: Trio -> generation thread ---------------------------------------


@dataclass(frozen=True, slots=True)
class Submit:
    """Admit ``job`` into the batch at the next step."""

    job: Job


@dataclass(frozen=True, slots=True)
class Cancel:
    """End job ``key`` with ``finish_reason: "cancelled"`` (its last events are posted)."""

    key: JobKey


@dataclass(frozen=True, slots=True)
class Drop:
    """Forget job ``key`` silently: its reader is gone."""

    key: JobKey


@dataclass(frozen=True, slots=True)
class Stop:
    """End every job with an ``engine_closed`` error and leave the loop."""


@dataclass(frozen=True, slots=True)
class Reset:
    """Zero the counters and empty the prefix cache, then call ``done`` (on
    the generation thread); used after the start-up warm-up."""

    done: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Sync:
    """Call ``done`` (on the generation thread) once every command sent
    before this one is applied and the step that follows has run and posted
    its outputs; a thread holding no job then waits for the next command.
    Lets a caller observe the thread settled without guessing a delay."""

    done: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Embed:
    """Pool the model's final hidden states over each of ``token_lists``
    (``pooling``: ``mean``, ``last`` or ``cls``), between two steps, then call
    ``done`` (on the generation thread) with the L2-normalized vectors, or
    with the exception that stopped them.  Skipped, ``done`` not called, when
    ``abandoned`` is set before the thread reaches it (the caller left)."""

    token_lists: tuple[tuple[int, ...], ...]
    pooling: str
    done: Callable[[list[list[float]] | BaseException], None]
    abandoned: threading.Event


Command: TypeAlias = Submit | Cancel | Drop | Stop | Reset | Sync | Embed


# -- outputs: generation thread -> Trio ----------------------------------------


class Delivery(NamedTuple):
    """One stream's share of one engine step."""

    events: tuple[Event, ...]
    finished: bool
    """The stream's last delivery: its mailbox closes after these events."""
    prompt_logprobs: PromptLogprobs | None = None
    """The scored prompt, in the delivery of the stream's first token."""


Outputs: TypeAlias = dict[JobKey, Delivery]
"""Everything one engine step produced, by job key (one hand-off per step)."""


# -- the Trio side's record of one request -------------------------------------


class RequestState(enum.Enum):
    """Where one request stands, as the Trio side sees it.

    ========================  ==============  ==================================
    from                      to              when
    ========================  ==============  ==================================
    PREPARING                 SUBMITTED       prepared; :class:`Submit` sent
    PREPARING                 CANCELLED       ``Engine.cancel``
    CANCELLED                 FINISHED        prepared; ``cancelled`` delivered
    SUBMITTED                 CANCELLING      ``Engine.cancel``; :class:`Cancel` sent
    SUBMITTED, CANCELLING     FINISHED        the thread's last events arrived
    SUBMITTED, CANCELLING     DROPPED         the reader left; :class:`Drop` sent
    ========================  ==============  ==================================

    A request whose preparation raises is forgotten where it stands.  Whether
    a submitted job waits, prefills or decodes is mlx-lm's to know: the Trio
    side cannot tell, and needs not.
    """

    PREPARING = enum.auto()
    """Templating and tokenizing in a worker thread; the generation thread has not heard of it."""
    SUBMITTED = enum.auto()
    """Handed to the generation thread (:class:`Submit`)."""
    CANCELLED = enum.auto()
    """Cancelled while preparing: it ends with ``finish_reason: "cancelled"`` as
    soon as preparation returns, without reaching the generation thread."""
    CANCELLING = enum.auto()
    """Cancelled after submission: a :class:`Cancel` is on its way and the
    thread answers with the last events."""
    FINISHED = enum.auto()
    """Its last events are in its mailbox."""
    DROPPED = enum.auto()
    """Its reader left before the end; a :class:`Drop` was sent."""


@dataclass(eq=False, slots=True)
class RequestRecord:
    """One in-flight request on the Trio side (:class:`~.inflight.InFlight`)."""

    request_id: RequestId
    key: JobKey
    mailbox: Mailbox
    t_submit: float
    """``time.perf_counter()`` when the request arrived."""
    state: RequestState = RequestState.PREPARING
    t_first: float | None = None
    """When its first events arrived from the generation thread (time to first token)."""
    prompt_logprobs: PromptLogprobs | None = None
    """The scored prompt, once it arrived (see :attr:`Delivery.prompt_logprobs`)."""
    group: RequestId | None = None
    """The id that also cancels this request (see ``Engine.stream``'s ``group``)."""

    @property
    def on_thread(self) -> bool:
        """The generation thread holds its job (or a command about it is on the way)."""
        return self.state in (RequestState.SUBMITTED, RequestState.CANCELLING)
