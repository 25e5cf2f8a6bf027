"""Build the compiled parts in ``ext/`` into ``afm_core``.

Each ``ext/NAME.pyx`` becomes the Cython module ``afm_core.NAME``; on Linux,
``ext/blas/cblas_shim.c`` becomes ``afm_core._cblas_shim``, the library that
binds MLX's BLAS calls to an optimized BLAS (``afm_core._blas``).  Set
``AFM_NO_EXTENSIONS=1`` to skip the build entirely; the package then runs on
its pure-Python twins and MLX's own BLAS.  A failed build (no compiler, no
Cython) warns and falls back instead of failing the installation.
"""

from __future__ import annotations

import os
import sys
from glob import glob
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
NO_EXTENSIONS = os.environ.get("AFM_NO_EXTENSIONS", "") not in ("", "0")
# AFM_EXT_ONLY=_detok_c,_sse_c limits a development rebuild to those modules.
ONLY = {n for n in os.environ.get("AFM_EXT_ONLY", "").split(",") if n}


class OptionalBuildExt(build_ext):
    """build_ext that degrades to the pure package when compiling fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any toolchain failure
            self._warn(exc)

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    @staticmethod
    def _warn(exc: BaseException) -> None:
        print(
            f"WARNING: building afm's Cython extensions failed ({exc!r}); "
            "the pure-Python twins will be used.",
            file=sys.stderr,
        )


def native_extensions() -> list:
    """Plain C libraries (loaded with ctypes, not imported)."""
    from setuptools import Extension

    if not sys.platform.startswith("linux"):
        return []  # MLX uses Accelerate (macOS); the BLAS shim is Linux-only
    return [
        Extension(
            "afm_core._cblas_shim",
            [str(Path("ext") / "blas" / "cblas_shim.c")],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
            libraries=["dl"],
        )
    ]


def extensions() -> list:
    if NO_EXTENSIONS:
        return []
    native = [e for e in native_extensions() if not ONLY or e.name.rsplit(".", 1)[1] in ONLY]
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("WARNING: Cython is missing; installing the pure package.", file=sys.stderr)
        return native
    from setuptools import Extension

    shared = sorted(glob(str(Path("ext") / "*.pxi")))  # included by the .pyx files
    modules = [
        Extension(f"afm_core.{Path(src).stem}", [src], extra_compile_args=["-O2"], depends=shared)
        for src in sorted(glob(str(Path("ext") / "*.pyx")))
        if not ONLY or Path(src).stem in ONLY
    ]
    return native + cythonize(
        modules,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "embedsignature": True,
        },
        quiet=True,
    )


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
