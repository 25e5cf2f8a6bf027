"""afm_core._mlx.malloc: freed buffers of a MiB or more go back to the system.

Each case runs in a fresh interpreter (glibc's settings are per process):
after ``import afm_core``, buffers of 8 MiB freed between live small ones (so
the heap could not shrink past them) leave the resident set where it was
before they were taken, even after a 16 MiB chunk was freed, the event that
raises glibc's moving threshold.  A user's own ``MALLOC_MMAP_THRESHOLD_`` and
``AFM_MALLOC=system`` leave glibc alone.  ``trim`` gives back the pages of
smaller blocks freed between live ones, which glibc's ``free`` keeps.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

PRELUDE = r"""
import ctypes, json
import afm_core
from afm_core._mlx import malloc

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) >> 10

def take(n):
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    return p
"""
"""What both probes start with: a fresh interpreter's ``afm_core``, glibc's
``malloc`` and ``free``, the resident set in MiB."""

PROBE = PRELUDE + r"""
libc.free(take(16 << 20))  # glibc's moving threshold would rise to 16 MiB here
before = rss()
blocks, pins = [], []
for _ in range(10):  # each block followed by a small live one: the heap cannot shrink past it
    blocks.append(take(8 << 20))
    pins.append(take(64 << 10))
held = rss()
for p in blocks:
    libc.free(p)
print(json.dumps({"tuned": malloc.tune(), "before": before, "held": held, "after": rss()}))
"""


def probe(**env: str) -> dict[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "AFM_MALLOC")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_freed_buffers_leave_the_process() -> None:
    got = probe()
    assert got["tuned"]
    assert got["held"] - got["before"] >= 70  # the ten blocks were resident
    assert got["after"] - got["before"] <= 10


def test_the_users_settings_win() -> None:
    assert not probe(AFM_MALLOC="system")["tuned"]
    assert not probe(MALLOC_MMAP_THRESHOLD_="65536")["tuned"]


TRIM_PROBE = PRELUDE + r"""
before = rss()
small, pins = [], []
for _ in range(1500):  # what a parser leaves: blocks freed between live ones
    small.append(take(64 << 10))
    pins.append(take(16 << 10))
held = rss()
for p in small:
    libc.free(p)
freed = rss()
trimmed = malloc.trim()
print(json.dumps({"trimmed": trimmed, "before": before, "held": held, "freed": freed, "after": rss()}))
"""


def test_trim_gives_the_heaps_free_pages_back() -> None:
    clean = {k: v for k, v in os.environ.items() if k != "AFM_MALLOC"}
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], env=clean, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["held"] - got["before"] >= 100  # 1,500 blocks of 64 KiB and their 16 KiB neighbours
    assert got["freed"] - got["held"] >= -10  # freed between live ones: still resident
    assert got["trimmed"] and got["freed"] - got["after"] >= 70  # given back, but for the neighbours
    system = subprocess.run([sys.executable, "-c", TRIM_PROBE], env={**clean, "AFM_MALLOC": "system"},
                            check=True, capture_output=True, text=True, timeout=120).stdout
    assert not json.loads(system.strip().splitlines()[-1])["trimmed"]
