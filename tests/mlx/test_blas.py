"""The optimized BLAS under MLX (afm_core._mlx.blas): in effect, and the fallbacks.

Each check runs in a fresh interpreter, since the binding is made once per
process, before MLX's first product.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from afm_core._mlx import blas as _blas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the BLAS shim is Linux-only (macOS uses Accelerate)")

_PRODUCT = """
import json, ctypes, numpy as np
import mlx.core as mx
from afm_core._mlx import blas as _blas
before = _blas.products_forwarded()
info = _blas.confirm()
a = np.random.default_rng(0).standard_normal((96, 160), dtype=np.float32)
b = np.random.default_rng(1).standard_normal((160, 72), dtype=np.float32)
got = np.array(mx.matmul(mx.array(a), mx.array(b), stream=mx.cpu))
out = dict(info.as_dict(), forwarded=_blas.products_forwarded() - before,
           err=float(np.abs(got - a @ b).max()), describe=info.describe())
"""


def run(code: str, env: dict[str, str] | None = None) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("AFM_BLAS")}
    full.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + "\nprint(json.dumps(out))"],
                          capture_output=True, text=True, env=full, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    return result


def test_the_shim_is_built() -> None:
    if os.environ.get("AFM_NO_EXTENSIONS", "") not in ("", "0"):
        pytest.skip("AFM_NO_EXTENSIONS: built without compiled parts")
    assert _blas._shim_path() is not None, "afm_core._mlx.cblas_shim is missing: run `make install`"


def test_openblas_computes_mlx_products() -> None:
    if _blas._shim_path() is None:
        pytest.skip("afm_core._mlx.cblas_shim is not built")
    out = run("import afm_core\n" + _PRODUCT + """
# which library the global cblas_sgemm, the one libmlx.so binds to, lives in
class Info(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
libc = ctypes.CDLL(None)
addr = ctypes.cast(libc.cblas_sgemm, ctypes.c_void_p)
found = Info()
assert libc.dladdr(addr, ctypes.byref(found))
out["library"] = found.fname.decode()
""")
    assert out["name"] == "openblas" and out["verified"] is True, out
    assert "OpenBLAS" in out["detail"] and out["threads"] == _blas.physical_cores()
    assert "cblas_shim" in out["library"]
    assert out["forwarded"] >= 2  # confirm()'s product and ours
    assert out["err"] < 1e-4
    assert "BLAS" not in out["stderr"]  # nothing to warn about


def test_reference_on_request() -> None:
    out = run("import afm_core\n" + _PRODUCT, {"AFM_BLAS": "reference"})
    assert out["name"] == "reference" and out["reason"] == "AFM_BLAS=reference"
    assert out["forwarded"] == 0 and out["err"] < 1e-4
    assert out["stderr"].count("reference BLAS") == 1, out["stderr"]  # one clear line


@pytest.mark.parametrize(("fake", "reason"), [
    ("sys.modules['scipy_openblas32'] = None", "scipy-openblas32 wheel is not installed"),
    ("""m = types.ModuleType('scipy_openblas32')
m.get_lib_dir = lambda: '/nonexistent'
m.get_library = lambda: 'scipy_openblas'
sys.modules['scipy_openblas32'] = m""", "loading OpenBLAS failed"),
])
def test_a_missing_or_broken_library_falls_back(fake: str, reason: str) -> None:
    out = run("import sys, types\n" + fake + "\nimport afm_core\n" + _PRODUCT)
    assert out["name"] == "reference" and reason in out["reason"], out
    assert out["forwarded"] == 0 and out["err"] < 1e-4  # MLX's own BLAS still computes
    assert out["stderr"].count("reference BLAS") == 1, out["stderr"]


def test_importing_mlx_first_is_reported() -> None:
    """libmlx.so binds cblas_sgemm as it loads: afm_core cannot come later."""
    out = run("import mlx.core\nimport afm_core\n" + _PRODUCT)
    assert out["name"] == "reference" and "imported before afm_core" in out["reason"]
    assert out["forwarded"] == 0 and out["err"] < 1e-4
    assert out["stderr"].count("reference BLAS") == 1, out["stderr"]


def test_a_binding_that_misses_mlx_is_caught() -> None:
    """Bound after MLX loaded (forced here), the products go elsewhere:
    confirm() sees none arrive and says so."""
    if _blas._shim_path() is None:
        pytest.skip("afm_core._mlx.cblas_shim is not built")
    out = run("""
import sys
import mlx.core
import afm_core._mlx.blas as b
b._info = None
saved = sys.modules.pop("mlx.core")
b.ensure_loaded()  # binds: it no longer sees mlx.core
sys.modules["mlx.core"] = saved
""" + _PRODUCT)
    assert out["name"] == "reference" and "do not reach" in out["reason"]
    assert out["forwarded"] == 0 and "do not reach it" in out["stderr"]


@pytest.mark.parametrize(("value", "threads", "warns"), [("1", 1, False), ("3", 3, False),
                                                          ("zero", None, True), ("0", None, True)])
def test_thread_count(value: str, threads: int | None, warns: bool) -> None:
    if _blas._shim_path() is None:
        pytest.skip("afm_core._mlx.cblas_shim is not built")
    out = run("import afm_core\n" + _PRODUCT, {"AFM_BLAS_THREADS": value})
    assert out["threads"] == (threads or _blas.physical_cores())
    assert ("not a positive integer" in out["stderr"]) is warns


def test_unknown_setting_is_reported() -> None:
    out = run("import afm_core\n" + _PRODUCT, {"AFM_BLAS": "fastest"})
    assert out["name"] == "reference" and "fastest" in out["reason"]


def test_a_forked_child_computes_through_openblas() -> None:
    """OpenBLAS's pool is used before the fork; the child computes through the
    same global cblas_sgemm (the shim) and gets the right answer, no hang."""
    if _blas._shim_path() is None:
        pytest.skip("afm_core._mlx.cblas_shim is not built")
    out = run("import afm_core\n" + _PRODUCT + """
import os
def sgemm(x, y):
    libc = ctypes.CDLL(None)
    m, k = x.shape; n = y.shape[1]
    c = np.zeros((m, n), dtype=np.float32)
    f = ctypes.POINTER(ctypes.c_float)
    libc.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, f, ctypes.c_int, f,
                                 ctypes.c_int, ctypes.c_float, f, ctypes.c_int]
    libc.cblas_sgemm(101, 111, 111, m, n, k, 1.0, x.ctypes.data_as(f), k,
                     y.ctypes.data_as(f), n, 0.0, c.ctypes.data_as(f), n)
    return c
x = np.random.default_rng(2).standard_normal((256, 256), dtype=np.float32)
assert np.allclose(sgemm(x, x), x @ x, atol=1e-3)
pid = os.fork()
if pid == 0:
    ok = np.allclose(sgemm(x, x), x @ x, atol=1e-3)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
out["child"] = os.waitstatus_to_exitcode(status)
""")
    assert out["child"] == 0


def test_physical_cores_is_sane() -> None:
    assert 1 <= _blas.physical_cores() <= (os.cpu_count() or 1)


_ONE_ROW = """
import json, numpy as np
import mlx.core as mx
from afm_core._mlx import blas as _blas
_blas.confirm()
rng = np.random.default_rng(0)
errs, sgemv = [], []
# one-row products as a decode step makes them: x @ W.T (W stored out x in) and x @ W,
# wide (N > K: the head, up-projections) and narrow (N < K: down-projections)
for k, n in ((64, 1000), (96, 96), (1000, 64)):
    x = rng.standard_normal((1, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    want = x @ w.T
    cases = (
        (mx.matmul(mx.array(x), mx.array(w).T, stream=mx.cpu), want),
        (mx.matmul(mx.array(x), mx.array(np.ascontiguousarray(w.T)), stream=mx.cpu), want),
        (mx.matmul(mx.array(x.T).T, mx.array(w).T, stream=mx.cpu), want),  # x as a column of A^T
        (mx.addmm(mx.ones((1, n)), mx.array(x), mx.array(w).T, alpha=0.5, beta=2.0, stream=mx.cpu),
         0.5 * want + 2.0),
    )
    for got, expected in cases:
        before = _blas.one_row_products()
        mx.eval(got)
        sgemv.append(_blas.one_row_products() - before)
        errs.append(float(np.abs(np.array(got) - expected).max()))
out = dict(errs=errs, sgemv=sgemv)
"""


@pytest.mark.parametrize(("mode", "routed"), [
    ("auto", [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]),  # N >= K only
    ("on", [1] * 12),
    ("off", [0] * 12),
])
def test_one_row_products_through_sgemv(mode: str, routed: list[int]) -> None:
    """``AFM_BLAS_GEMV``: a one-row product goes to sgemv as the mode says
    (``auto``: when the output is at least as wide as the input), and every
    result, transposed operands and alpha/beta included, equals numpy's."""
    if _blas._shim_path() is None:
        pytest.skip("afm_core._mlx.cblas_shim is not built")
    out = run("import afm_core\n" + _ONE_ROW, {"AFM_BLAS_GEMV": mode})
    assert out["sgemv"] == routed, out
    assert max(out["errs"]) < 1e-3, out
