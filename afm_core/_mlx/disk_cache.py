"""The prefix cache's disk tier: entries as files, an index, a background I/O thread.

:class:`DiskPromptCache` keeps prompt caches in a directory, one file per
entry (:mod:`.cache_file`: mlx-lm's prompt-cache format with a checksum),
named from the model's fingerprint and the entry's token ids.  The
generation thread owns the index: the entries' token ids in a
:class:`~.prefix_cache.PrefixTrie` (so a lookup matches as the memory tier
does: exact, shorter or longer prefix) and their order of last use (the
least recently used goes first when the byte budget is exceeded).  Files are
written, read, checked and deleted by one I/O thread; the generation thread
only hands it work and collects what is done (:meth:`DiskPromptCache.poll`),
so no file operation runs between two decode steps.

* **Writing** (:meth:`save`): the arrays of a cache the generation thread
  has evaluated (``mx.async_eval``) cross to the I/O thread as ``mx.array``
  objects; it reads their bytes (the buffer protocol waits for an evaluation
  still running, and needs no stream), checksums and writes them atomically.
  A pending write is dropped when a longer one with its tokens as a prefix
  comes (trimmable caches only, as the memory tier drops such prefixes);
  when written, the entry joins the index and the prefixes it covers leave
  it.
* **Reading** (:meth:`load`): the I/O thread reads the whole file, checks the
  checksum and builds ``mx.array`` objects from the bytes (a copy, no MLX
  operation); :meth:`poll` turns them into cache objects.  A file that fails
  (corrupt, truncated, gone) is deleted and leaves the index: never served.
  Reads go before queued writes.
* **At start** the directory is scanned: every entry file's header (token
  ids, model fingerprint, length) is read; entries of another model (or of
  another KV-cache format, ``kv_bits``: the fingerprint covers it) are left
  alone and not counted; a truncated or unreadable entry file is deleted;
  the order of use is the files' modification times (a hit touches its file).
  Temporary files of writes a killed process left are deleted.
* **LoRA adapters**: an entry computed under adapter ``i`` (1-based, the
  engine's index) carries :func:`adapted_fingerprint` of the model's and
  the adapter's (a digest of its files' bytes, ``lora.adapter_fingerprint``),
  and is indexed under ``i``: a lookup for adapter ``i`` sees only those, the
  base model's (index 0) keep the model's own fingerprint.  A restart with
  other weights under the same name has another fingerprint: the old entries
  are another model's to it.

* **Pins** (cache breakpoints, as the memory tier's:
  :class:`~.prefix_cache.PinningPromptCache`): :meth:`DiskPromptCache.pin`
  holds a prefix for a ttl of ``clock``; eviction takes the least recently
  used entry that is not the most recently used holder of a live pin, and a
  pinned one only when no other is left.  Pins live in the process: a
  restart forgets them (the entries stay, in their order of use).

One directory should belong to one server process at a time: two processes
each evict by their own index (a file the other deletes is then a miss
there, never a wrong answer).

May import: mlx, mlx-lm, numpy and the standard library.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache_file import (
    CorruptEntry,
    build_cache,
    encode_cache,
    read_entry,
    read_header,
    write_entry,
)
from .pins import Pins
from .prefix_cache import PrefixTrie, served_prefix

__all__ = ["DiskEntry", "DiskMatch", "DiskPromptCache", "DiskStats", "Loaded", "adapted_fingerprint",
           "model_fingerprint"]

log = logging.getLogger("afm.engine")

_PREFIX = "afmkv-"
_SUFFIX = ".safetensors"
_MAX_PENDING_WRITE_BYTES = 1 << 30
"""Bytes of arrays waiting to be written at most; beyond, the oldest pending
write is dropped (the disk is slower than requests finish)."""


def model_fingerprint(model_key: str, kv_format: str = "") -> str:
    """What a cache entry must have been computed by to be served: the model
    directory's path, its ``config.json`` and its weight files' names, sizes
    and modification times (a model rebuilt at the same path is another
    model), or ``model_key`` itself when it is no directory; and the cache's
    format, ``kv_format`` (``""``: float, as before it existed; ``"q8g64"``:
    ``kv_bits`` 8, ``kv_group_size`` 64), so an engine never reads an entry
    quantized otherwise than its own rows: to it that is another model's."""
    path = Path(model_key)
    h = hashlib.sha256(str(path.resolve() if path.exists() else model_key).encode())
    if kv_format:
        h.update(f"\nkv:{kv_format}".encode())
    if path.is_dir():
        config = path / "config.json"
        if config.is_file():
            h.update(config.read_bytes())
        for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf")):
            st = weights.stat()
            h.update(f"\n{weights.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def adapted_fingerprint(model: str, adapter: str) -> str:
    """The fingerprint of caches computed by the model ``model`` (its
    :func:`model_fingerprint`) under the adapter ``adapter`` (its content's
    fingerprint)."""
    return hashlib.sha256(f"{model}\nadapter:{adapter}".encode()).hexdigest()[:32]


@dataclass(eq=False)
class DiskEntry:
    """One entry in the index (``adapter``: the index of the adapter it was
    computed under, 0 for none; the trie's key)."""

    name: str
    tokens: tuple[int, ...]
    nbytes: int
    trimmable: bool
    adapter: int = 0


@dataclass(frozen=True, slots=True)
class DiskMatch:
    """What the disk tier would serve a prompt: ``served`` tokens of it from
    ``entry`` (which holds ``len(entry.tokens)``)."""

    entry: DiskEntry
    served: int


@dataclass(frozen=True, slots=True)
class Loaded:
    """A finished read: the entry's cache (None when the file failed; it is
    gone from the index then)."""

    entry: DiskEntry
    cache: list[Any] | None


@dataclass
class DiskStats:
    """The tier's state and counters (since start or the last :meth:`DiskPromptCache.reset`)."""

    entries: int = 0
    bytes: int = 0
    writes: int = 0
    written_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    evictions: int = 0
    corrupt: int = 0
    """Files found corrupt or truncated (deleted, never served)."""
    dropped_writes: int = 0
    """Writes given up: superseded by a longer entry before they started, or
    over the pending-bytes cap, or failed (disk full, permissions)."""


@dataclass(eq=False)
class _Write:
    name: str
    tokens: tuple[int, ...]
    trimmable: bool
    arrays: dict[str, Any]
    classes: list[str]
    scalars: list[Any]
    nbytes: int
    adapter: int = 0


@dataclass
class _IO:
    """The work queues shared with the I/O thread (under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ready: threading.Condition = field(init=False)
    reads: collections.deque[DiskEntry] = field(default_factory=collections.deque)
    writes: collections.deque[_Write] = field(default_factory=collections.deque)
    chores: collections.deque[tuple[str, str]] = field(default_factory=collections.deque)  # (op, name)
    done: collections.deque[tuple[str, Any, Any]] = field(default_factory=collections.deque)
    idle: threading.Condition = field(init=False)
    busy: int = 0
    closing: bool = False

    def __post_init__(self) -> None:
        self.ready = threading.Condition(self.lock)  # work for the thread
        self.idle = threading.Condition(self.lock)  # a job of the thread's is done


class DiskPromptCache:
    """See the module docstring.  Every method runs on the generation thread;
    ``wake`` is called from the I/O thread when some work is done (the
    worker then calls :meth:`poll`)."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, fingerprint: str,
                 wake: Callable[[], None] = lambda: None, adapters: Sequence[str] = ()):
        """``adapters``: the content fingerprints of the adapters the engine
        serves, in index order (from 1); their entries are kept too."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max(int(max_bytes), 0)
        self.fingerprint = fingerprint
        self._models = [fingerprint, *(adapted_fingerprint(fingerprint, a) for a in adapters)]
        self._adapter_of = {m: i for i, m in enumerate(self._models)}
        self.wake = wake
        self.clock: Callable[[], float] = time.monotonic
        self._pins = Pins()  # keyed by (adapter, prefix)
        self.stats = DiskStats()
        self._trie = PrefixTrie()
        self._lru: collections.OrderedDict[str, DiskEntry] = collections.OrderedDict()  # oldest use first
        self._loading: set[str] = set()
        self._session: set[str] = set()  # names this process wrote and that were not indexed before
        self._io = _IO()
        self._scan()
        self._unlink_now()  # what the scan evicted
        self._scan_corrupt = self.stats.corrupt
        self._thread = threading.Thread(target=self._run, name="afm-cache-io", daemon=True)
        self._thread.start()

    # -- the index ------------------------------------------------------------------

    def _name(self, tokens: tuple[int, ...], adapter: int = 0) -> str:
        h = hashlib.sha256(self._models[adapter].encode())
        h.update(json.dumps(list(tokens)).encode())
        return f"{_PREFIX}{h.hexdigest()[:40]}{_SUFFIX}"

    def _scan(self) -> None:
        found: list[tuple[int, DiskEntry]] = []
        for path in self.dir.iterdir():
            name = path.name
            if not name.startswith(_PREFIX):
                continue
            if name.endswith(".tmp"):
                if _regular(path):
                    _remove_stale_temp(path)
                continue
            if not name.endswith(_SUFFIX) or not _regular(path):
                continue  # (a FIFO would block the open forever; a link could point anywhere)
            try:
                head = read_header(path)
                mtime = path.stat().st_mtime_ns
            except KeyError:
                continue  # another format's file
            except CorruptEntry as exc:
                log.warning("prefix cache: deleting %s: %s", path, exc)
                self.stats.corrupt += 1
                path.unlink(missing_ok=True)
                continue
            except OSError:
                continue
            adapter = self._adapter_of.get(head.model)
            if adapter is None:
                continue  # another model's (or adapter's)
            found.append((mtime, DiskEntry(name, head.tokens, head.size, head.trimmable, adapter)))
        for _, entry in sorted(found, key=lambda item: item[0]):
            self._index(entry)
        self._evict()

    def _index(self, entry: DiskEntry) -> None:
        old = self._lru.pop(entry.name, None)
        if old is not None:  # the file was written again (its tokens: the same, unless it was altered)
            self._trie.pop(old.adapter, list(old.tokens))
            self.stats.bytes -= old.nbytes
        self._trie.add(entry.adapter, list(entry.tokens), entry)
        self._lru[entry.name] = entry
        self.stats.bytes += entry.nbytes
        self.stats.entries = len(self._lru)

    def _unindex(self, entry: DiskEntry, in_trie: bool = True) -> bool:
        if self._lru.get(entry.name) is not entry:
            return False
        del self._lru[entry.name]
        if in_trie:
            self._trie.pop(entry.adapter, list(entry.tokens))
        self.stats.bytes -= entry.nbytes
        self.stats.entries = len(self._lru)
        return True

    def _delete(self, entry: DiskEntry, in_trie: bool = True) -> None:
        if self._unindex(entry, in_trie):
            self._chore("delete", entry.name)

    def pin(self, tokens: list[int], ttl: float, adapter: int = 0) -> None:
        """Hold the entries that begin with ``tokens`` (their most recently used
        one) against eviction for ``ttl`` seconds from now."""
        self._pins.pin(adapter, tokens, ttl, self.clock())

    def refresh(self, tokens: list[int], adapter: int = 0) -> None:
        """A request read ``tokens`` from the cache: the live pins on a prefix of them
        hold for their ttl from now again."""
        self._pins.refresh(adapter, tokens, self.clock())

    def pins(self) -> dict[tuple[Any, tuple[int, ...]], float]:
        """The live pins, ``(adapter, prefix) -> expiry`` (the expired ones are forgotten)."""
        return self._pins.live(self.clock())

    def _held(self) -> set[str]:
        """The names of the entries holding a live pin (forgetting the expired pins)."""
        pins = self.pins()
        held: set[str] = set()
        if not pins:
            return held
        recent = list(reversed(self._lru.values()))
        for adapter, prefix in pins:
            n = len(prefix)
            for entry in recent:
                if entry.adapter == adapter and len(entry.tokens) >= n and entry.tokens[:n] == prefix:
                    held.add(entry.name)
                    break
        return held

    def _evict(self) -> None:
        while self.stats.bytes > self.max_bytes and self._lru:
            held = self._held()
            entries = iter(self._lru.values())
            oldest = next(entries)
            entry = oldest if oldest.name not in held else next((e for e in entries if e.name not in held), oldest)
            self._delete(entry)
            self.stats.evictions += 1

    def __len__(self) -> int:
        return len(self._lru)

    def nearest(self, tokens: list[int], adapter: int = 0) -> DiskMatch | None:
        """The entry computed under ``adapter`` that would serve the most of
        ``tokens`` (the memory tier's rules:
        :func:`~.prefix_cache.served_prefix`), or None."""
        if not 0 <= adapter < len(self._models):
            return None
        found = served_prefix(self._trie, adapter, tokens, lambda e: e.trimmable)
        if found is None:
            return None
        entry, served = found
        return DiskMatch(entry, served)

    # -- work for the I/O thread ------------------------------------------------------

    def load(self, entry: DiskEntry) -> bool:
        """Read ``entry`` (its :class:`Loaded` comes from :meth:`poll`); False
        if a read of it is already under way (its result serves both)."""
        self._lru.move_to_end(entry.name)
        if entry.name in self._loading:
            return False
        self._loading.add(entry.name)
        with self._io.lock:
            self._io.reads.append(entry)
            self._io.ready.notify()
        return True

    def save(self, tokens: list[int], cache: list[Any], trimmable: bool, adapter: int = 0) -> None:
        """Write ``cache`` (of ``tokens``, computed under ``adapter``; evaluated,
        or being evaluated with ``mx.async_eval``) to disk, in the background."""
        key = tuple(tokens)
        if not 0 <= adapter < len(self._models):
            self.stats.dropped_writes += 1
            return
        arrays, classes, scalars = encode_cache(cache)
        nbytes = sum(int(getattr(a, "nbytes", 0)) for a in arrays.values())
        if nbytes > self.max_bytes:
            self.stats.dropped_writes += 1
            return
        write = _Write(self._name(key, adapter), key, trimmable, arrays, classes, scalars, nbytes, adapter)
        with self._io.lock:
            pending = self._io.writes
            if trimmable:  # a longer entry covers the pending writes of its prefixes
                kept = [w for w in pending if not (w.adapter == adapter and len(w.tokens) < len(key)
                                                   and key[:len(w.tokens)] == w.tokens)]
                self.stats.dropped_writes += len(pending) - len(kept)
                pending.clear()
                pending.extend(kept)
            pending.append(write)
            while len(pending) > 1 and sum(w.nbytes for w in pending) > _MAX_PENDING_WRITE_BYTES:
                pending.popleft()
                self.stats.dropped_writes += 1
            self._io.ready.notify()

    def _chore(self, op: str, name: str) -> None:
        with self._io.lock:
            self._io.chores.append((op, name))
            self._io.ready.notify()

    def poll(self) -> list[Loaded]:
        """Apply the writes done since the last call to the index (evicting
        beyond the budget) and return the reads done."""
        with self._io.lock:
            done = list(self._io.done)
            self._io.done.clear()
        loaded: list[Loaded] = []
        for kind, job, result in done:
            if kind == "write":
                self._written(job, result)
            else:
                loaded.append(self._read(job, result))
        return loaded

    def _written(self, write: _Write, result: int | BaseException) -> None:
        if isinstance(result, BaseException):
            log.warning("prefix cache: could not write %s: %s", self.dir / write.name, result)
            self.stats.dropped_writes += 1
            return
        if write.name not in self._lru:
            self._session.add(write.name)
        self.stats.writes += 1
        self.stats.written_bytes += result
        entry = DiskEntry(write.name, write.tokens, result, write.trimmable, write.adapter)
        self._index(entry)
        if write.trimmable:  # as the memory tier: the prefixes it covers go
            for _, covered in self._trie.pop_prefixes(write.adapter, list(write.tokens)):
                self._delete(covered, in_trie=False)
        self._evict()

    def _read(self, entry: DiskEntry, result: Any) -> Loaded:
        self._loading.discard(entry.name)
        if isinstance(result, BaseException):
            if isinstance(result, CorruptEntry):
                log.warning("prefix cache: deleting %s: %s", self.dir / entry.name, result)
                self.stats.corrupt += 1
            else:
                log.warning("prefix cache: cannot read %s: %s", self.dir / entry.name, result)
            self._delete(entry)
            return Loaded(entry, None)
        head, arrays, classes, scalars = result
        if head.model != self._models[entry.adapter] or head.tokens != entry.tokens:
            # replaced by another file of the same name? (another process): not this entry
            self._delete(entry)
            return Loaded(entry, None)
        try:
            cache = build_cache(arrays, classes, scalars)
        except (CorruptEntry, ValueError, TypeError) as exc:
            log.warning("prefix cache: deleting %s: %s", self.dir / entry.name, exc)
            self.stats.corrupt += 1
            self._delete(entry)
            return Loaded(entry, None)
        self.stats.reads += 1
        self.stats.read_bytes += head.size
        return Loaded(entry, cache)

    def reset(self) -> None:
        """Forget this process's writes so far (the start-up warm-up's: the
        write under way is waited for, the queued ones dropped, the files
        deleted here) and zero the counters (but the corrupt files the
        start-up scan found); what the directory held at start stays."""
        io = self._io
        with io.lock:
            self.stats.dropped_writes += len(io.writes)
            io.writes.clear()
            while io.busy:
                io.idle.wait()
        self.poll()
        for name in list(self._session):
            entry = self._lru.get(name)
            if entry is not None:
                self._delete(entry)
        self._session.clear()
        self._unlink_now()  # (and the warm-up's entries its longer ones covered)
        self.stats = DiskStats(entries=len(self._lru), bytes=self.stats.bytes, corrupt=self._scan_corrupt)

    @property
    def idle(self) -> bool:
        """No read, write or deletion queued or running."""
        with self._io.lock:
            return not (self._io.reads or self._io.writes or self._io.chores or self._io.busy or self._io.done)

    def close(self) -> None:
        """Finish the queued writes and deletions, then stop the I/O thread."""
        with self._io.lock:
            self._io.closing = True
            self._io.reads.clear()
            self._io.ready.notify()
        self._thread.join()
        self.poll()
        self._unlink_now()  # what that poll evicted (the thread is gone)

    def _unlink_now(self) -> None:
        """Delete the files queued for deletion, on this thread."""
        while True:
            with self._io.lock:
                if not self._io.chores:
                    return
                _, name = self._io.chores.popleft()
            (self.dir / name).unlink(missing_ok=True)

    # -- the I/O thread ---------------------------------------------------------------

    def _run(self) -> None:
        io = self._io
        while True:
            with io.lock:
                while not (io.reads or io.writes or io.chores or io.closing):
                    io.ready.wait()
                if io.reads:
                    job: Any = ("read", io.reads.popleft())
                elif io.chores:
                    job = ("chore", io.chores.popleft())
                elif io.writes:
                    job = ("write", io.writes.popleft())
                else:
                    return  # closing, nothing left
                io.busy += 1
            kind, work = job
            result: Any = None
            try:
                if kind == "read":
                    if not _regular(self.dir / work.name):
                        raise CorruptEntry("not a regular file")
                    result = read_entry(self.dir / work.name)
                    with contextlib.suppress(OSError):
                        os.utime(self.dir / work.name)  # its last use, for the order after a restart
                elif kind == "write":
                    fields = {"model": self._models[work.adapter], "tokens": json.dumps(list(work.tokens)),
                              "trimmable": "1" if work.trimmable else "0"}
                    result = write_entry(self.dir / work.name, work.arrays, work.classes, work.scalars, fields)
                    work.arrays = {}  # the arrays may go now
                elif work[0] == "delete":
                    (self.dir / work[1]).unlink(missing_ok=True)
            except Exception as exc:  # noqa: BLE001 - reported through poll()
                result = exc
            with io.lock:
                io.busy -= 1
                if kind != "chore":
                    io.done.append((kind, work, result))
                io.idle.notify_all()
            if kind != "chore":
                self.wake()


def _regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (not a link, FIFO, socket or device):
    only those are opened."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _remove_stale_temp(path: Path) -> None:
    """Delete a temporary file (``<entry>.<pid>.tmp``) whose writer process is gone."""
    try:
        pid = int(path.name.rsplit(".", 2)[-2])
    except (ValueError, IndexError):
        return
    if pid != os.getpid():
        try:
            os.kill(pid, 0)
            return  # still running: its write is under way
        except ProcessLookupError:
            pass
        except PermissionError:
            return
    else:
        return
    path.unlink(missing_ok=True)
