"""Which served models are in memory: the pure bookkeeping behind ``afm serve --model A --model B``.

:class:`ModelTable` decides, without any I/O (no Trio, no MLX; the caller
passes the time), what :mod:`afm_http._registry` does with each model:

* every model is ``unloaded``, ``loading``, ``loaded`` or ``unloading``;
* a request holds its model from before it is loaded until its response
  ended (:meth:`ModelTable.acquire` / :meth:`ModelTable.release`), so a model
  with requests is never unloaded;
* when the last request of a model ends, its idle TTL starts: the request's
  ``keep_alive`` (as Ollama's: seconds, or ``"5m"``; 0 unloads at once, a
  negative value never) or the server's ``--keep-alive``; :meth:`expired`
  lists the models whose TTL ran out;
* with a memory budget (``--max-loaded-bytes``), :meth:`plan_load` names the
  idle models to unload, least recently used first, so a model fits beside
  the resident ones (loading, loaded and still unloading models count), or
  None when it cannot fit until a busy model becomes idle.  A model larger
  than the whole budget loads alone.  The budget may still evict a model
  whose TTL has not run out (even one kept forever): the TTL says how long an
  idle model may stay, the budget whether there is room for it.

A model's size is the bytes of its weights files on disk (an estimate of
what it holds in memory: MLX maps the weights as stored; a GGUF file
converted to float32 grows, and the table takes the converted size once it
was loaded).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["FOREVER", "ModelState", "ModelTable", "Residency", "parse_keep_alive"]

ModelState = Literal["unloaded", "loading", "loaded", "unloading"]

FOREVER = math.inf
"""A keep-alive that never runs out (a negative ``keep_alive``)."""

RESIDENT: tuple[ModelState, ...] = ("loading", "loaded", "unloading")

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")


def parse_keep_alive(value: object) -> float:
    """Seconds an idle model stays loaded, from Ollama's ``keep_alive``: a number
    of seconds or a Go duration string (``"5m"``, ``"1h30m"``, ``"-1"``, ``"10"``);
    0 unloads right after the request, a negative value keeps it (:data:`FOREVER`).
    Raises ValueError for anything else (booleans, NaN, ``"soon"``)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("keep_alive must be a number of seconds or a duration such as '5m'")
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)  # a bare number is seconds, as Ollama takes it
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a number of seconds or a "
                                 "duration such as '5m', '1h30m' or '-1'") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
        value = sign * seconds
    if math.isnan(value) or value == math.inf:
        raise ValueError("keep_alive must be finite (negative keeps the model loaded)")
    return FOREVER if value < 0 else float(value)


@dataclass(slots=True)
class Residency:
    """One model's line in the table (read it; :class:`ModelTable` changes it)."""

    id: str
    size: int
    """Weights bytes (the estimate the budget counts)."""
    keep_alive: float
    """The idle TTL that applies once its requests end (the last request's own, else the default)."""
    state: ModelState = "unloaded"
    inflight: int = 0
    """Requests holding it (waiting for its load, or answered by it)."""
    last_used: float = -math.inf
    """When a request of it last began or ended (the LRU order)."""
    expires: float | None = None
    """When it unloads if it stays idle (None: busy, not loaded, or kept forever)."""
    loads: int = 0
    load_seconds: float = 0.0
    """Seconds spent loading, summed over :attr:`loads`."""
    last_load_seconds: float | None = None
    load_failures: int = 0
    unloads: Counter[str] = field(default_factory=Counter)
    """Unloads by reason: ``idle`` (its TTL ran out), ``evicted`` (room for another)."""


class ModelTable:
    """The state of every served model; see the module docstring."""

    def __init__(self, models: Iterable[tuple[str, int]], *, keep_alive: float = FOREVER,
                 max_bytes: int | None = None) -> None:
        self.keep_alive = keep_alive
        self.max_bytes = max_bytes
        self._rows: dict[str, Residency] = {}
        for model_id, size in models:
            if model_id in self._rows:
                raise ValueError(f"two models have the id {model_id!r}")
            self._rows[model_id] = Residency(model_id, max(0, size), keep_alive)

    def __getitem__(self, model_id: str) -> Residency:
        return self._rows[model_id]

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._rows

    def __iter__(self) -> Iterator[Residency]:
        return iter(self._rows.values())

    def ids(self) -> list[str]:
        return list(self._rows)

    def resident_bytes(self, *, excluding: str | None = None) -> int:
        """Bytes of the models loading, loaded or unloading."""
        return sum(r.size for r in self._rows.values() if r.state in RESIDENT and r.id != excluding)

    # -- requests ------------------------------------------------------------------

    def acquire(self, model_id: str, now: float) -> None:
        """A request for the model began: it stays (or will be) loaded while held."""
        row = self._rows[model_id]
        row.inflight += 1
        row.last_used = now
        row.expires = None

    def release(self, model_id: str, now: float, keep_alive: float | None = None) -> None:
        """A request ended; ``keep_alive`` is its own TTL (None: the default).  The
        last one starts the idle TTL."""
        row = self._rows[model_id]
        if row.inflight <= 0:
            raise RuntimeError(f"model {model_id!r} released more often than acquired")
        row.inflight -= 1
        row.last_used = now
        row.keep_alive = self.keep_alive if keep_alive is None else keep_alive
        self._arm(row, now)

    def _arm(self, row: Residency, now: float) -> None:
        idle = row.inflight == 0 and row.state == "loaded"
        row.expires = now + row.keep_alive if idle and row.keep_alive != FOREVER else None

    # -- loading and unloading ----------------------------------------------------

    def plan_load(self, model_id: str) -> list[str] | None:
        """The idle models to unload (least recently used first) so ``model_id`` fits
        the budget: ``[]`` when it fits as things are, None when it cannot fit until a
        busy (or loading) model becomes idle or an unloading one is gone."""
        row = self._rows[model_id]
        if row.state != "unloaded":
            raise RuntimeError(f"model {model_id!r} is {row.state}")
        if self.max_bytes is None:
            return []
        need = min(row.size, self.max_bytes)  # alone, a model larger than the budget still loads
        resident = self.resident_bytes(excluding=model_id)
        victims: list[str] = []
        idle = sorted((r for r in self._rows.values()
                       if r.state == "loaded" and r.inflight == 0 and r.id != model_id),
                      key=lambda r: r.last_used)
        for candidate in [None, *idle]:
            if candidate is not None:
                victims.append(candidate.id)
                resident -= candidate.size
            if resident + need <= self.max_bytes:
                return victims
        return None

    def begin_load(self, model_id: str) -> None:
        row = self._rows[model_id]
        if row.state != "unloaded":
            raise RuntimeError(f"model {model_id!r} is {row.state}")
        row.state = "loading"
        row.expires = None

    def loaded(self, model_id: str, now: float, seconds: float, size: int | None = None) -> None:
        """The load ended well after ``seconds``; ``size``: the loaded weights' bytes, when known."""
        row = self._rows[model_id]
        row.state = "loaded"
        row.loads += 1
        row.load_seconds += seconds
        row.last_load_seconds = seconds
        if size:
            row.size = size
        self._arm(row, now)

    def load_failed(self, model_id: str) -> None:
        row = self._rows[model_id]
        row.state = "unloaded"
        row.load_failures += 1
        row.expires = None

    def begin_unload(self, model_id: str, reason: str) -> None:
        """Only an idle loaded model unloads (its requests hold it otherwise)."""
        row = self._rows[model_id]
        if row.state != "loaded" or row.inflight:
            raise RuntimeError(f"model {model_id!r} is {row.state} with {row.inflight} request(s)")
        row.state = "unloading"
        row.expires = None
        row.unloads[reason] += 1

    def unloaded(self, model_id: str) -> None:
        row = self._rows[model_id]
        row.state = "unloaded"
        row.expires = None

    # -- the idle TTL ---------------------------------------------------------------

    def expired(self, now: float) -> list[str]:
        """The idle loaded models whose TTL ran out by ``now``."""
        return [r.id for r in self._rows.values()
                if r.state == "loaded" and r.inflight == 0 and r.expires is not None
                and r.expires <= now]

    def next_expiry(self) -> float | None:
        """When the next idle model's TTL runs out (None: none will)."""
        times = [r.expires for r in self._rows.values() if r.expires is not None]
        return min(times, default=None)
