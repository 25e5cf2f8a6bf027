"""Perplexity of a fixed text: afm served against llama.cpp on the same file.

The text is ``corpus.txt`` beside this module (prose and code).  Both sides
score the *same token ids* (llama.cpp's tokenization of the text, cut at
``n`` tokens), so a difference is the models', not the tokenizers':

* :func:`llamacpp_logprobs`: ``llama-cpp-python`` (``logits_all``), 2 threads;
* :func:`served_logprobs`: ``afm serve --model FILE`` in a subprocess (a real
  server on 127.0.0.1), scored through ``/v1/completions`` with ``echo``,
  ``logprobs: 0`` and ``max_tokens: 0``.

Used by ``benchmarks/gguf_perplexity.py`` and the opt-in test
``tests/models/test_real_gguf.py``; needs ``httpx`` and ``llama-cpp-python``
(the ``test`` and ``bench-llamacpp`` extras).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CORPUS", "llamacpp_logprobs", "llamacpp_token_ids", "perplexity", "served_logprobs"]

CORPUS = Path(__file__).resolve().parent / "corpus.txt"


def perplexity(logprobs: Sequence[float] | np.ndarray) -> float:
    """``exp`` of the mean negative log-probability."""
    return math.exp(-float(np.mean(np.asarray(logprobs, dtype=np.float64))))


def _llama(path: Path, n_ctx: int) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=2, logits_all=True,
                 verbose=False)


def llamacpp_token_ids(path: str | os.PathLike[str], n: int, text: str | None = None) -> list[int]:
    """llama.cpp's tokens of ``text`` (default: the corpus), BOS as the
    file asks, cut at ``n``."""
    llm = _llama(Path(path), 64)
    text = CORPUS.read_text(encoding="utf-8") if text is None else text
    return list(llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))[:n]


def llamacpp_logprobs(path: str | os.PathLike[str], ids: Sequence[int]) -> list[float]:
    """log p(ids[i+1] | ids[:i+1]) for each i, by llama.cpp on the GGUF ``path``."""
    llm = _llama(Path(path), len(ids) + 16)
    llm.eval(list(ids))
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    logz = np.log(np.exp(logits).sum(axis=1))
    return [float(logits[i, ids[i + 1]] - logz[i]) for i in range(len(ids) - 1)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def served_logprobs(model: str | os.PathLike[str], ids: Sequence[int], *, home: str | os.PathLike[str],
                    startup_timeout: float = 1800.0) -> tuple[list[float], float]:
    """(the same log-probabilities by ``afm serve --model MODEL``, seconds
    until it answered ``/health``: conversion included on a fresh ``home``)."""
    import httpx

    port = _free_port()
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "serve.log"
    cmd = [str(Path(sys.executable).parent / "afm"), "serve", "--model", str(model), "--port", str(port)]
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env={**os.environ, "AFM_HOME": str(home)}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            while not _healthy(base):
                if proc.poll() is not None or time.monotonic() - t0 > startup_timeout:
                    raise RuntimeError(f"afm serve did not start:\n{log_path.read_text()[-3000:]}")
                time.sleep(1)
            ready = time.monotonic() - t0
            body = {"prompt": list(ids), "echo": True, "logprobs": 0, "max_tokens": 0}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=3600)
            r.raise_for_status()
            lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            if len(lps) != len(ids) or lps[0] is not None:
                raise RuntimeError(f"expected {len(ids)} prompt log-probabilities, got {len(lps)}")
            return [float(x) for x in lps[1:]], ready
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _healthy(base: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
