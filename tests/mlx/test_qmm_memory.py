"""The quantized products' memory on a prompt chunk: what stays and what peaks.

Each case runs in a fresh interpreter and reads its own resident set
(``/proc/self/status``; the peak reset through ``/proc/self/clear_refs``)
around one product of 2,048 rows (a prefill chunk) through a gate/up
family's weight of Qwen2.5-0.5B's shape (896 -> 2 x 4,864, 4 bits):

* the split product (``quantized_matmul_split``, two 38 MiB outputs) gives
  back everything but its outputs once they are freed: its columns go
  straight into the outputs, no whole-product buffer kept by the thread that
  ran it (before: 76 MiB, kept for the life of the process);
* the product with the SwiGLU epilogue (``quantized_matmul_swiglu``) peaks at
  its one 38 MiB output and a few MiB of pieces, where the split product and
  the SwiGLU held three such arrays at once.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from afm_core._mlx import qmatmul as _qmatmul

pytestmark = [
    pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self"),
    pytest.mark.skipif(_qmatmul.extension() is None or not _qmatmul.extension().has_sgemm(),
                       reason="afm_core._mlx.qmm_ext is not built, or products of many rows "
                              "have no sgemm here"),
]

PROBE = r"""
import json, sys
import afm_core
import mlx.core as mx
from afm_core._mlx import qmatmul

def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) / 1024

ext = qmatmul.extension()
K, I, M = 896, 4864, 2048
w, scales, biases = mx.quantize(mx.random.normal((2 * I, K)) * 0.1, 32, 4)
x = mx.random.normal((M, K))
mx.eval(w, scales, biases, x)
warm = ext.quantized_matmul(x[:64], w, scales, biases, 32, 4)  # sgemm's own buffers, once
mx.eval(warm)
del warm
mx.clear_cache()
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
if sys.argv[1] == "swiglu":
    outs = [ext.quantized_matmul_swiglu(x, w, scales, biases, 32, 4)]
else:
    outs = ext.quantized_matmul_split(x, w, scales, biases, 32, 4, [I, I])
mx.eval(outs)
peak = status("VmHWM")
del outs
mx.clear_cache()
print(json.dumps({"before": before, "peak": peak, "after": status("VmRSS"),
                  "output": M * I * 4 / 2**20}))
"""


def probe(kind: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("AFM_MALLOC", None)
    done = subprocess.run([sys.executable, "-c", PROBE, kind], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_split_product_keeps_nothing_of_its_size_once_its_outputs_are_freed():
    m = probe("split")
    assert m["peak"] - m["before"] >= 2 * m["output"] * 0.9, m  # the two outputs were there
    assert m["after"] - m["before"] < m["output"] / 2, m


def test_the_swiglu_epilogue_peaks_at_its_one_output():
    m = probe("swiglu")
    assert m["output"] * 0.9 <= m["peak"] - m["before"] < 2 * m["output"], m
    assert m["after"] - m["before"] < m["output"] / 2, m
