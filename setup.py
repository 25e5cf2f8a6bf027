"""Build the compiled parts in ``ext/`` into ``afm_core``.

Each ``ext/stream/NAME.pyx`` becomes the Cython module ``afm_core._stream.NAME``
(the twin of ``afm_core/_stream/NAME_py.py``); on Linux,
``ext/blas/cblas_shim.c`` becomes ``afm_core._mlx.cblas_shim``, the library that
binds MLX's BLAS calls to an optimized BLAS (``afm_core._mlx.blas``).  Set
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
# AFM_EXT_ONLY=detok_c,sse_c limits a development rebuild to those modules.
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
            "afm_core._mlx.cblas_shim",
            [str(Path("ext") / "blas" / "cblas_shim.c")],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
            libraries=["dl"],
        )
    ]


def qmm_extensions() -> list:
    """``afm_core._mlx.qmm_ext`` (``ext/qmm/``): the quantized matmul MLX primitive.

    C++20 against the headers and ``libmlx`` of the installed mlx wheel, with
    nanobind's library compiled in (domain ``mlx``, as mlx's own module), so it
    needs mlx and the nanobind whose internals version mlx was built with.
    Missing any of them: a warning and ``mx.quantized_matmul`` at run time.
    x86-64 kernels are compiled per function for AVX2 / AVX-512 VNNI and chosen
    at run time, so the baseline flags stay the compiler's defaults.
    """
    from setuptools import Extension

    try:
        import mlx
        import nanobind
    except ImportError as exc:
        print(f"WARNING: not building afm_core._mlx.qmm_ext ({exc}); MLX's quantized "
              "matmul will be used.", file=sys.stderr)
        return []
    mlx_dir = Path(next(iter(mlx.__path__)))
    nb_dir = Path(nanobind.__file__).parent
    # mlx.core and this module must share nanobind's internals (same version tag)
    try:
        header = (nb_dir / "src" / "nb_internals.h").read_text()
        version = header.split("#  define NB_INTERNALS_VERSION", 1)[1].split()[0]
        cores = list(mlx_dir.glob("core*.so")) + list(mlx_dir.glob("core*.pyd"))
        compatible = bool(cores) and f"_v{version}".encode() in cores[0].read_bytes()
    except (OSError, IndexError) as exc:
        compatible, version = False, repr(exc)
    if not compatible or not (mlx_dir / "include" / "mlx" / "primitives.h").exists():
        print(f"WARNING: not building afm_core._mlx.qmm_ext: nanobind {nanobind.__version__} "
              f"(internals {version}) does not match mlx's build, or mlx has no headers.",
              file=sys.stderr)
        return []
    lib_dir = str(mlx_dir / "lib")
    src = Path("ext") / "qmm"
    link_args, rpaths = [], []
    if sys.platform == "darwin":
        link_args = ["-Wl,-rpath,@loader_path/../../mlx/lib", f"-Wl,-rpath,{lib_dir}"]
    else:
        rpaths = ["$ORIGIN/../../mlx/lib", lib_dir]  # installed beside mlx; editable
    return [
        Extension(
            "afm_core._mlx.qmm_ext",
            [str(src / "qmm_kernels.cpp"), str(src / "kquant_kernels.cpp"), str(src / "attention_kernels.cpp"),
             str(src / "layer_ops.cpp"), str(src / "quantized_attention.cpp"),
             str(src / "prefill_attention.cpp"), str(src / "qmm_ext.cpp"),
             str(src / "nb_lib.cpp")],
            language="c++",
            include_dirs=[str(nb_dir / "include"), str(nb_dir / "ext" / "robin_map" / "include"),
                          str(nb_dir / "src"), str(mlx_dir / "include")],
            define_macros=[("NB_DOMAIN", "mlx")],
            extra_compile_args=["-O3", "-std=c++20", "-fvisibility=hidden",
                                "-fno-strict-aliasing"],
            library_dirs=[lib_dir],
            libraries=["mlx"],
            runtime_library_dirs=rpaths,
            extra_link_args=link_args,
            depends=[str(p) for p in sorted(src.glob("*.h")) + sorted(src.glob("*.inc"))],
        )
    ]


def extensions() -> list:
    if NO_EXTENSIONS:
        return []
    native = [e for e in native_extensions() + qmm_extensions()
              if not ONLY or e.name.rsplit(".", 1)[1] in ONLY]
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("WARNING: Cython is missing; installing the pure package.", file=sys.stderr)
        return native
    from setuptools import Extension

    stream = Path("ext") / "stream"
    shared = sorted(glob(str(stream / "*.pxi")))  # included by the .pyx files
    modules = [
        Extension(f"afm_core._stream.{Path(src).stem}", [src], extra_compile_args=["-O2"],
                  depends=shared)
        for src in sorted(glob(str(stream / "*.pyx")))
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
