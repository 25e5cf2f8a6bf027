"""Issue 31, case 9: a FIFO in ``--cache-dir`` hung the start-up (the scan
opened every entry-named file, and opening a FIFO waits for a writer).  Only
regular files are opened now; links, FIFOs and sockets are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

START = """
import sys, trio
from afm_core import open_engine

async def main():
    async with open_engine(sys.argv[1], cache_dir=sys.argv[2], warmup=False) as engine:
        out = await engine.complete({"messages": [{"role": "user", "content": "still works"}]})
        print(out["choices"][0]["message"]["content"])
        print("entries", engine.statistics().prefix_cache_disk_entries)

trio.run(main)
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")
def test_a_fifo_or_a_link_in_the_cache_dir_is_left_alone(echo_model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    name = "afmkv-" + "0" * 40 + ".safetensors"
    os.mkfifo(cache / name)
    os.mkfifo(cache / ("afmkv-" + "1" * 40 + ".safetensors.123.tmp"))
    (tmp_path / "elsewhere.safetensors").write_bytes(b"not an entry")
    (cache / ("afmkv-" + "2" * 40 + ".safetensors")).symlink_to(tmp_path / "elsewhere.safetensors")
    try:
        done = subprocess.run([sys.executable, "-c", START, str(echo_model_dir), str(cache)],
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("the engine did not start: it is stuck opening the FIFO")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[0] == "still works"
    assert (cache / name).exists() and (tmp_path / "elsewhere.safetensors").read_bytes() == b"not an entry"
