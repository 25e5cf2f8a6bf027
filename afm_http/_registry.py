"""The models one server serves, each loaded on first use and unloaded when idle.

``afm serve --model A --model B`` (or ``--models-dir DIR``) serves several
models from one process.  :class:`ModelRegistry` maps each model id to its
:class:`ModelSpec` and, while it is loaded, to its own
:class:`~afm_core.Engine` (its own generation thread and batcher).  Routes get
their engine with ``async with registry.use(model, keep_alive) as engine``
(through ``AppState.engine_for``), which holds the model for the request's
whole life, streaming included:

* an unknown ``model`` is a 404 ``model_not_found`` (with a single model any
  name is accepted, as before: ``strict`` is False);
* a model that is not loaded starts loading in the registry's nursery
  (``open_engine``: the weights load on the engine's own generation thread,
  so the Trio thread, and every other model's streams, go on); concurrent
  first requests share that one load; a model still unloading is waited for
  and loaded again: a request never fails halfway because of an unload;
* when the last request ends, the model's idle TTL starts (``--keep-alive``,
  or the request's own ``keep_alive``); the reaper task unloads it once it ran
  out; with ``--max-loaded-bytes`` a load first unloads the least recently
  used idle models it needs room from, or waits until a busy one is idle.

The decisions are :class:`afm_http._residency.ModelTable`'s (pure, unit
tested); this module does the I/O: engines, events, the log.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from afm_core import (
    AdapterNotFoundError,
    AFMError,
    Engine,
    EngineClosedError,
    EngineConfig,
    ModelLoadError,
    RequestError,
    find_local_model,
    local_models,
    open_engine,
)
from afm_core.api.defaults import model_defaults

from ._residency import FOREVER, ModelTable, Residency

__all__ = ["ModelChoice", "ModelRegistry", "ModelSpec", "Opener", "model_spec", "models_in_dir",
           "open_models", "weights_bytes"]

log = logging.getLogger("afm.models")

Opener = Callable[[str, EngineConfig], AbstractAsyncContextManager[Engine]]
"""How a model's engine is opened (``open_engine(source, config=config)``; tests wrap it)."""

WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf")


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What a request asks of the registry: its ``model`` and ``keep_alive`` fields."""

    model: str | None = None
    keep_alive: float | None = None
    """Seconds its model stays loaded once idle (None: the server's ``--keep-alive``)."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One servable model: its id (what a request's ``model`` names), what to load, its size."""

    id: str
    source: str
    """A model directory, a ``.gguf`` file or a Hugging Face repo id (``open_engine``'s ``model``)."""
    size: int = 0
    """Its weights' bytes on disk (0: unknown until loaded, e.g. a hub id not fetched yet)."""
    adapters: tuple[tuple[str, str], ...] = ()
    """LoRA adapters served on it, ``(name, directory)`` (``afm serve --adapter``): a
    request names one as ``model: "id:name"`` (or ``adapters``), ``/v1/models`` lists them so."""
    defaults: tuple[tuple[str, Any], ...] = ()
    """Its own sampling defaults (an Ollama model's ``params`` layer, as
    :func:`afm_core.api.defaults.model_defaults` keeps them), filled into its
    requests' absent fields."""


def weights_bytes(path: str | Path) -> int:
    """The bytes of a model's weights files (a directory's ``*.safetensors``, or a
    ``.gguf`` file's size); 0 when there are none."""
    p = Path(path)
    try:
        if p.is_file():
            return p.stat().st_size
        if p.is_dir():
            return sum(f.stat().st_size for f in p.iterdir()
                       if f.is_file() and f.suffix.lower() in WEIGHT_SUFFIXES)
    except OSError:
        pass
    return 0


def model_spec(source: str | Path, *, named: str | None = None) -> ModelSpec:
    """The spec of a ``--model`` value: a directory's id is its name (what
    ``Engine.model_id`` says), a ``.gguf`` file's its stem, a hub id or a store
    name itself.  ``named``: the ``--model`` value ``source`` was resolved from
    (a store name), whose model's sampling defaults the spec keeps."""
    text = str(source)
    path = Path(text).expanduser()
    defaults = store_defaults(named if named is not None else text)
    if path.is_dir():
        return ModelSpec(path.name, str(path), weights_bytes(path), defaults=defaults)
    if path.is_file():
        name = path.stem if path.suffix.lower() == ".gguf" else path.name
        return ModelSpec(name, str(path), weights_bytes(path), defaults=defaults)
    return ModelSpec(text, text, 0, defaults=defaults)


def store_defaults(spec: str) -> tuple[tuple[str, Any], ...]:
    """The sampling defaults of the store model ``spec`` names (an Ollama model's
    ``params`` layer), as :attr:`ModelSpec.defaults`; none for anything else."""
    path = Path(spec).expanduser()
    if not spec or path.is_dir() or path.is_file():
        return ()
    try:
        found = find_local_model(spec)
    except ModelLoadError:
        return ()  # (loading it says why)
    return _defaults_of(found.details.get("params")) if found is not None else ()


def _defaults_of(params: Any) -> tuple[tuple[str, Any], ...]:
    if not isinstance(params, dict):
        return ()
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in model_defaults(params).items())


def models_in_dir(directory: str | Path) -> list[ModelSpec]:
    """The models in ``directory`` (``--models-dir``), by name: each subdirectory
    that is an mlx-lm model (``config.json`` and weights) and each ``.gguf`` file;
    for a local store's folder (Ollama's, LM Studio's, the Hugging Face cache),
    each of its models under its store name (``qwen2.5-coder:0.5b``,
    ``publisher/repo/file.gguf``, ``org/name``)."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ModelLoadError(f"--models-dir {root} is not a directory")
    found = [ModelSpec(m.name.partition(":")[2], str(m.path), m.size,
                       defaults=_defaults_of(m.details.get("params"))) for m in local_models(root)]
    for child in sorted(root.iterdir(), key=lambda p: p.name):
        if child.name.startswith("."):
            continue
        if child.is_dir() and (child / "config.json").is_file() and weights_bytes(child) > 0:
            found.append(model_spec(child))
        elif child.is_file() and child.suffix.lower() == ".gguf":
            found.append(model_spec(child))
    return found


@dataclass(eq=False, slots=True)
class _Hold:
    """One load of a model, until it is unloaded again."""

    done: trio.Event = field(default_factory=trio.Event)
    """Set once loaded, or once the load failed (``error``)."""
    error: str | None = None
    unload: trio.Event = field(default_factory=trio.Event)
    """Set to unload it (only ever while it is idle)."""
    gone: trio.Event = field(default_factory=trio.Event)
    """Set once its engine is closed (or its load failed)."""


@dataclass(eq=False, slots=True)
class _Slot:
    spec: ModelSpec
    engine: Engine | None = None
    hold: _Hold | None = None
    context_length: int | None = None
    """The context of its last load (shown in ``/v1/models`` while unloaded)."""


class ModelRegistry:
    """See the module docstring.  Run it with :func:`open_models` (or
    ``nursery.start(registry.run)``); :meth:`serving` wraps one engine that is
    already open (kept loaded, any ``model`` name accepted)."""

    def __init__(self, specs: Sequence[ModelSpec], *, config: EngineConfig | None = None,
                 keep_alive: float = FOREVER, max_loaded_bytes: int | None = None,
                 strict: bool | None = None, pinned: bool = False,
                 opener: Opener | None = None) -> None:
        if not specs:
            raise ModelLoadError("no model to serve")
        self.config = config or EngineConfig()
        self.strict = len(specs) > 1 if strict is None else strict
        """Whether a request's ``model`` must name a served model (else any name means the default)."""
        self.pinned = pinned
        """Ignore the requests' ``keep_alive`` (one model without ``--keep-alive``: kept, as always)."""
        self.table = ModelTable(((s.id, s.size) for s in specs), keep_alive=keep_alive,
                                max_bytes=max_loaded_bytes)
        self._slots = {s.id: _Slot(s) for s in specs}
        self.default_id = specs[0].id
        """The model a request without ``model`` gets (the first one given)."""
        self._opener: Opener = opener or (lambda source, cfg: open_engine(source, config=cfg))
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self.created = int(time.time())

    @classmethod
    def serving(cls, engine: Engine) -> ModelRegistry:
        """A registry of one engine already open (``create_app(engine)``): loaded, kept."""
        registry = cls([ModelSpec(engine.model_id, str(engine.model_path),
                                  weights_bytes(engine.model_path), engine.config.adapters)],
                       config=engine.config, pinned=True)
        slot = registry._slots[registry.default_id]
        slot.engine = engine
        slot.context_length = engine.context_length
        slot.hold = _Hold()
        slot.hold.done.set()
        registry.table.begin_load(registry.default_id)
        registry.table.loaded(registry.default_id, 0.0, 0.0)
        return registry

    # -- what the routes use ---------------------------------------------------------

    def resolve(self, model: str | None) -> str:
        """The id of the model a request's ``model`` names (None or "": the default);
        ``id:adapter`` names model ``id`` (its engine checks the adapter)."""
        if not model or not self.strict:
            return self.default_id
        if model in self.table:
            return model
        head, colon, tail = model.rpartition(":")
        if colon and head in self.table:
            if tail not in dict(self._slots[head].spec.adapters):
                raise AdapterNotFoundError(f"The model '{head}' has no adapter '{tail}': GET /v1/models "
                                           "lists the adapters served as model:adapter")
            return head
        raise RequestError(f"The model '{model}' does not exist: GET /v1/models lists the models "
                           "served here", param="model", status=404, code="model_not_found")

    @asynccontextmanager
    async def use(self, model: str | None = None, keep_alive: float | None = None) -> AsyncIterator[Engine]:
        """The engine of the model ``model`` names, loaded if needed, held until the
        block ends (it is not unloaded meanwhile); then its idle TTL starts:
        ``keep_alive`` seconds (None: the registry's; :data:`FOREVER`: never)."""
        model_id = self.resolve(model)
        slot = self._slots[model_id]
        if self.pinned:
            keep_alive = None
        self.table.acquire(model_id, trio.current_time())
        try:
            yield await self._ready(slot)
        finally:
            self.table.release(model_id, trio.current_time(), keep_alive)
            self._notify()

    async def load(self, model: str | None = None) -> Engine:
        """Load a model now (``afm serve`` with one model loads it before listening)."""
        async with self.use(model) as engine:
            return engine

    def engines(self) -> list[Engine]:
        """The engines of the models loaded now (in the order the models were given)."""
        return [s.engine for s in self._slots.values()
                if s.engine is not None and self.table[s.spec.id].state == "loaded"]

    def engine_of(self, model_id: str) -> Engine | None:
        """The engine of ``model_id`` if it is loaded now."""
        slot = self._slots.get(model_id)
        if slot is None or self.table[model_id].state != "loaded":
            return None
        return slot.engine

    def all_engines(self) -> list[Engine]:
        """Every open engine, loaded or unloading (a cancel or a drain reaches them all)."""
        return [s.engine for s in self._slots.values() if s.engine is not None]

    def specs(self) -> list[ModelSpec]:
        """Every served model's spec, in the order the models were given."""
        return [s.spec for s in self._slots.values()]

    def defaults_for(self, model: Any) -> dict[str, Any]:
        """The sampling defaults of the model a request's ``model`` names (none when it
        names no served model: the route's own lookup says so)."""
        try:
            model_id = self.resolve(model if isinstance(model, str) else None)
        except AFMError:
            return {}
        return dict(self._slots[model_id].spec.defaults)

    def rows(self) -> Iterator[tuple[Residency, Engine | None]]:
        """Every model's table row and its engine when loaded."""
        for slot in self._slots.values():
            row = self.table[slot.spec.id]
            yield row, slot.engine if row.state == "loaded" else None

    def card(self, model_id: str) -> dict[str, Any] | None:
        """The ``/v1/models`` entry of a served model (OpenAI's fields, the context
        and its ``state``) or of one of its adapters (``id:adapter``, with its
        ``parent`` as vLLM lists LoRA modules), None if it is not served here."""
        slot = self._slots.get(model_id)
        if slot is None:
            head, colon, name = model_id.rpartition(":")
            base = self._slots.get(head) if colon else None
            if base is None or name not in dict(base.spec.adapters):
                return None
            card = self.card(head)
            assert card is not None
            return {**card, "id": model_id, "parent": head}
        out: dict[str, Any] = {"id": model_id, "object": "model", "created": self.created,
                               "owned_by": "afm"}
        if slot.context_length is not None:
            out["context_length"] = out["max_model_len"] = slot.context_length
        out["state"] = self.table[model_id].state
        return out

    def cards(self) -> list[dict[str, Any]]:
        ids = [i for mid in self.table.ids() for i in (mid, *(f"{mid}:{name}" for name, _ in
                                                             self._slots[mid].spec.adapters))]
        return [c for mid in ids if (c := self.card(mid)) is not None]

    # -- loading and unloading ----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[ModelRegistry] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve loads and unloads until cancelled; then every engine is closed."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            try:
                await self._reap()
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()

    async def _reap(self) -> None:
        """Unload each idle model once its TTL ran out."""
        while True:
            for model_id in self.table.expired(trio.current_time()):
                self._begin_unload(self._slots[model_id], "idle")
            changed = self._changed
            deadline = self.table.next_expiry()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await changed.wait()

    def _notify(self) -> None:
        """Wake whoever waits for a change (room, a TTL, a load)."""
        self._changed.set()
        self._changed = trio.Event()

    async def _ready(self, slot: _Slot) -> Engine:
        model_id = slot.spec.id
        said_waiting = False
        while True:
            row = self.table[model_id]
            hold = slot.hold
            if row.state == "loaded":
                assert slot.engine is not None
                return slot.engine
            if row.state == "loading":
                assert hold is not None
                await hold.done.wait()
                if hold.error is not None:
                    raise ModelLoadError(f"model {model_id!r} could not be loaded: {hold.error}")
                continue
            if row.state == "unloading":
                assert hold is not None
                await hold.gone.wait()  # then load it again
                continue
            if self._nursery is None:
                raise EngineClosedError(f"model {model_id!r} is not loaded and the server is closing")
            victims = self.table.plan_load(model_id)
            if victims is None:
                if not said_waiting:
                    said_waiting = True
                    log.info("model %s waits for room: %s of --max-loaded-bytes %s held by busy models",
                             model_id, self.table.resident_bytes(), self.table.max_bytes)
                changed = self._changed
                await changed.wait()
                continue
            self._start_load(slot, victims)

    def _start_load(self, slot: _Slot, victims: list[str]) -> None:
        assert self._nursery is not None
        gates = []
        for victim in victims:
            other = self._slots[victim]
            self._begin_unload(other, "evicted", for_model=slot.spec.id)
            assert other.hold is not None
            gates.append(other.hold.gone)
        self.table.begin_load(slot.spec.id)
        slot.hold = _Hold()
        self._nursery.start_soon(self._hold, slot, slot.hold, gates)
        self._notify()

    def _begin_unload(self, slot: _Slot, reason: str, *, for_model: str | None = None) -> None:
        self.table.begin_unload(slot.spec.id, reason)
        why = f"room for {for_model}" if for_model else "idle for its keep-alive"
        log.info("unloading model %s (%s)", slot.spec.id, why)
        assert slot.hold is not None
        slot.hold.unload.set()
        self._notify()

    def _config_for(self, spec: ModelSpec) -> EngineConfig:
        """The engine settings, with a disk cache directory of its own per model."""
        config = replace(self.config, adapters=spec.adapters) if spec.adapters else self.config
        cache_dir = config.cache_dir
        if cache_dir is None or len(self._slots) == 1:
            return config
        safe = re.sub(r"[^\w.-]+", "_", spec.id)
        return replace(config, cache_dir=Path(cache_dir) / safe)

    async def _hold(self, slot: _Slot, hold: _Hold, gates: list[trio.Event]) -> None:
        """Load the model, keep it until asked to unload it, close it."""
        model_id = slot.spec.id
        loaded = failed = False
        try:
            for gate in gates:  # the models unloaded to make room are gone first
                await gate.wait()
            size = f", {slot.spec.size / 1e6:.1f} MB of weights" if slot.spec.size else ""
            log.info("loading model %s (%s%s)", model_id, slot.spec.source, size)
            started = trio.current_time()
            async with self._opener(slot.spec.source, self._config_for(slot.spec)) as engine:
                now = trio.current_time()
                slot.engine = engine
                slot.context_length = engine.context_length
                self.table.loaded(model_id, now, now - started, weights_bytes(engine.model_path))
                loaded = True
                log.info("model %s loaded in %.2f s", model_id, now - started)
                hold.done.set()
                self._notify()
                await hold.unload.wait()
                slot.engine = None  # nothing new reaches it (it is "unloading" already)
        except Exception as exc:  # noqa: BLE001 - a failed load fails its requests, not the server
            failed = True
            error: BaseException = exc
            while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
                error = error.exceptions[0]
            hold.error = error.message if isinstance(error, AFMError) else f"{type(error).__name__}: {error}"
            log.warning("model %s: %s", model_id, hold.error)
        finally:
            slot.engine = None
            if loaded:
                self.table.unloaded(model_id)
                log.info("model %s unloaded", model_id)
            elif failed or self.table[model_id].state == "loading":
                self.table.load_failed(model_id)
                hold.error = hold.error or "the server is closing"
            hold.done.set()
            hold.gone.set()
            self._notify()


@asynccontextmanager
async def open_models(specs: Sequence[ModelSpec], *, config: EngineConfig | None = None,
                      keep_alive: float = FOREVER, max_loaded_bytes: int | None = None,
                      strict: bool | None = None, pinned: bool = False, preload: Sequence[str] = (),
                      opener: Opener | None = None) -> AsyncIterator[ModelRegistry]:
    """A running :class:`ModelRegistry`, with the ``preload`` models loaded first;
    leaving the block closes every engine."""
    registry = ModelRegistry(specs, config=config, keep_alive=keep_alive,
                             max_loaded_bytes=max_loaded_bytes, strict=strict, pinned=pinned,
                             opener=opener)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        try:
            for model_id in preload:
                await registry.load(model_id)
            yield registry
        finally:
            nursery.cancel_scope.cancel()
