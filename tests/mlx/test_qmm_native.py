"""The kernels outside MLX: ``ext/qmm/qmm_check.cpp`` built and run on its own.

The check runs every kernel set the machine (or emulator) runs, over every bit
width, group, scale type and activation precision, with the bounds of
``tests/mlx/test_qmatmul.py`` (see its docstring), and a row's bits alone and
among 1 to 17 rows.  Natively it checks this CPU's sets once more without
MLX; built with Debian's ``g++-aarch64-linux-gnu`` and run under
``qemu-aarch64`` it is how an x86 machine tests the NEON kernels, with and
without the dot-product instructions.  Each test skips when its compiler or
emulator is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "ext" / "qmm"
SOURCES = [str(SRC / "qmm_kernels.cpp"), str(SRC / "kquant_kernels.cpp"), str(SRC / "qmm_check.cpp")]


def _build_and_run(compiler: str, flags: list[str], out: Path, runner: list[str],
                   sets: list[str]) -> str:
    build = subprocess.run([compiler, "-O2", "-std=c++20", "-Wall", f"-I{SRC}", *flags,
                            *SOURCES, "-o", str(out)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([*runner, str(out), *sets], capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run.stdout


def test_native_kernel_sets(tmp_path):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++")
    out = _build_and_run(compiler, [], tmp_path / "check", [], [])
    assert "0 failures" in out and "scalar" in out


@pytest.mark.parametrize("arch", ["armv8.2-a+dotprod", "armv8-a"])
def test_neon_kernels_under_qemu(tmp_path, arch):
    compiler = shutil.which("aarch64-linux-gnu-g++")
    qemu = shutil.which("qemu-aarch64")
    if compiler is None or qemu is None:
        pytest.skip("needs Debian's g++-aarch64-linux-gnu and qemu-user")
    # (the scalar oracle ran natively above; emulated it only costs time)
    out = _build_and_run(compiler, [f"-march={arch}", "-static"], tmp_path / "check", [qemu],
                         ["neon"])
    assert "kernel sets: neon;" in out and "0 failures" in out
