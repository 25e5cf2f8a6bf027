"""How far ahead of the computation MLX's encoder may queue afm operations
(``ext/qmm/cpu_task.h``): an operation waits while the outputs of afm
operations queued and not yet computed exceed ``in_flight_limit``.

MLX allocates an operation's output when it queues it, so without the limit
a chain of operations on a prompt chunk's arrays holds the outputs of every
queued one at once.  With it, a chain of large outputs holds about the
limit plus the few operations around the one running, however long the
chain: the bound here holds whatever the threads' speeds.  Outputs under a
MiB (a decode step's) are not held back.  The results are the same bits either way.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import qmatmul as _qmatmul

ext = _qmatmul.extension()
pytestmark = pytest.mark.skipif(ext is None, reason="afm_core._mlx.qmm_ext is not built or disabled")

MIB = 1 << 20
ROWS, DIM = 1024, 1024  # 4 MiB of float32 per array


@pytest.fixture
def limit():
    before = ext.in_flight_limit()
    yield ext.set_in_flight_limit
    ext.set_in_flight_limit(before)


def _chain(x: mx.array, w: mx.array, n: int) -> mx.array:
    for _ in range(n):
        x = ext.rms_norm(x, w, 1e-5)
    return x


def _peak_of_chain(n: int) -> tuple[np.ndarray, float]:
    mx.random.seed(3)
    x, w = mx.random.normal((ROWS, DIM)), mx.random.normal((DIM,))
    mx.eval(x, w)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = _chain(x, w, n)
    mx.eval(out)
    return np.array(out), (mx.get_peak_memory() - base) / MIB


def test_the_limit_bounds_a_chain_of_large_outputs(limit):
    assert ext.in_flight_limit() > 0
    _, waits_before = ext.in_flight_stats()
    limit(2 * MIB)  # less than one output: each operation queued waits for the one before
    bounded, peak = _peak_of_chain(24)
    assert ext.in_flight_stats() == (0, ext.in_flight_stats()[1])  # nothing left in flight
    assert ext.in_flight_stats()[1] > waits_before
    # the running operation's input and output, the next one's output (allocated before it
    # waited) and an output whose release is queued behind the operation that used it: a few
    # outputs, however long the chain (24 of them, 96 MiB, without the limit)
    assert peak <= 5 * 4, peak
    limit(1 << 40)
    free, _ = _peak_of_chain(24)
    np.testing.assert_array_equal(bounded, free)


def _waits_of_chain(rows: int) -> int:
    _, before = ext.in_flight_stats()
    x, w = mx.random.normal((rows, DIM)), mx.random.normal((DIM,))
    mx.eval(_chain(x, w, 40))
    return ext.in_flight_stats()[1] - before


def test_outputs_under_a_mib_neither_wait_nor_count(limit):
    """A decode step's outputs (a few hundred KiB per layer at 8 streams of
    a 1.5B model) go as MLX queues them, whatever the limit."""
    limit(1)
    assert _waits_of_chain(127) == 0  # 508 KiB outputs
    assert ext.in_flight_stats()[0] == 0
    assert _waits_of_chain(256) > 0  # 1 MiB outputs


def test_the_limit_is_a_setting(limit):
    limit(5 * MIB)
    assert ext.in_flight_limit() == 5 * MIB
