"""The kernel and model-level tests again, on every other CPU path this machine runs.

``make test`` runs everything on the best kernel set the CPU has (AVX-512
VNNI here, say), but most users' x86 CPUs have AVX2 only, and OpenBLAS picks
other kernels there (Haswell).  Numerics differ between the paths (float
summation order, which products take the integer or the sgemm path), so a
tolerance that one CPU happens to meet can fail on another.  This module
reruns the suites whose results depend on the kernels (``tests/mlx``,
``tests/engine``, ``tests/models``) in a child pytest for each other kernel
set ``qmm_ext.available_isas()`` lists, with ``AFM_QMM_ISA`` forcing it; the
AVX2 run also sets ``OPENBLAS_CORETYPE=Haswell``, the BLAS kernels an AVX2
machine gets.  A failure shows the child's summary.

Nothing runs twice on a CPU with one kernel set, and a child never starts its
own children; with ``AFM_QMM_ISA`` already set (you chose a path) or without
the extension, the tests skip saying why.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from afm_core._mlx import qmatmul

ROOT = Path(__file__).resolve().parent.parent
SUITES = ("tests/mlx", "tests/engine", "tests/models")
CHILD_ENV = "AFM_KERNEL_PATHS_CHILD"
# The OpenBLAS kernels an AVX2-only x86 CPU gets (the others keep OpenBLAS's own choice).
OPENBLAS_CORE = {"avx2": "Haswell"}

_ext = qmatmul.extension()
ISAS = list(_ext.available_isas()) if _ext is not None else []
OTHER_PATHS = ISAS[:-1]  # the last is the default, which the main run covers


def _skip_reason() -> str | None:
    if os.environ.get(CHILD_ENV):
        return "already inside a kernel-path run"
    if _ext is None:
        return "afm_core._mlx.qmm_ext is not built (or AFM_NO_QMM / AFM_NO_EXTENSIONS is set)"
    if os.environ.get("AFM_QMM_ISA"):
        return f"AFM_QMM_ISA={os.environ['AFM_QMM_ISA']} chose one path for this whole run"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
@pytest.mark.parametrize("isa", OTHER_PATHS or ["none"])
def test_kernel_and_model_suites_on_another_path(isa: str) -> None:
    if isa == "none":
        pytest.skip(f"this CPU runs one kernel set only ({', '.join(ISAS)})")
    env = dict(os.environ, AFM_QMM_ISA=isa, **{CHILD_ENV: "1"})
    core = OPENBLAS_CORE.get(isa) if platform.machine() in ("x86_64", "AMD64") else None
    if core is not None:
        env["OPENBLAS_CORETYPE"] = core
    argv = [sys.executable, "-m", "pytest", *SUITES, "-p", "no:cacheprovider", "-x"]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    out = proc.stdout + proc.stderr
    forced = f"AFM_QMM_ISA={isa}" + (f" OPENBLAS_CORETYPE={core}" if core else "")
    assert proc.returncode == 0, (f"{forced}: {' '.join(SUITES)} failed (exit {proc.returncode}):\n"
                                  + "\n".join(out.splitlines()[-60:]))
    assert f"afm kernels: {isa}" in out, f"{forced}: the child did not run the {isa} kernels"
