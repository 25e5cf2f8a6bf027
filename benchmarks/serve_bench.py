"""Served vs raw vs peers: a thin wrapper around ``afm bench``.

Run: ``.venv/bin/python benchmarks/serve_bench.py [afm bench flags...]``

With no flags: the random tiny test model, closed-loop concurrency 1, 8, 32
and 64, raw mlx-lm ``BatchGenerator`` in-process, ``mlx_lm.server`` and
``afm serve`` (skipped when ``afm_http`` is not installed), all on
127.0.0.1.  Writes ``report.json``, ``report.txt`` and ``report.png`` under
``bench-results/bench-TIMESTAMP/`` and prints the table.  Any ``afm bench``
flag passes through (``--model DIR``, ``--rate 5,20``, ``--profile``, ...).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from afm_core._cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
