"""The real lm-evaluation-harness (``lm_eval``, pinned in ``.ci/deps.sh``, in a
virtual environment of its own: it brings torch) against a real afm server on
the tiny random model, with its defaults: ``local-completions`` probes
``GET /tokenizer_info``, picks its remote tokenizer backend (afm's vLLM-shaped
``/tokenize`` and ``/detokenize``) and never reaches for the Hugging Face hub,
which is offline here.  Two local tasks (a JSON file, no dataset download):
multiple choice (log-likelihoods of token-id prompts with ``echo`` and
``logprobs``) and generation until a newline.

Skipped when ``lm_eval`` is not found (``$AFM_LM_EVAL``, else on PATH)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import httpx
import pytest
import trio

from afm_http.testing import running_server

VERSION = "0.4.13"
LM_EVAL = os.environ.get("AFM_LM_EVAL") or shutil.which("lm_eval")
INSTALL = (f"python3 -m venv /opt/lm-eval && /opt/lm-eval/bin/pip install 'lm_eval[api]=={VERSION}' "
           "torch==2.13.0, then put /opt/lm-eval/bin/lm_eval on PATH or in $AFM_LM_EVAL (.ci/deps.sh does)")
pytestmark = pytest.mark.skipif(LM_EVAL is None, reason=f"lm_eval is not installed: {INSTALL}")

DOCS = [{"question": "What color is the sky?", "choices": ["blue", "green"], "answer": 0},
        {"question": "How many legs has a cat?", "choices": ["four", "nine", "two"], "answer": 0}]
TASKS = {
    "afm_choice": {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
                   "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]},
    "afm_generate": {"output_type": "generate_until", "doc_to_target": "{{choices[answer]}}",
                     "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8},
                     "metric_list": [{"metric": "exact_match"}]},
}


def write_tasks(folder: Path) -> None:
    """The two tasks as lm-eval YAML (JSON is YAML) over one local JSON-lines file."""
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, fields in TASKS.items():
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", "doc_to_text": "Question: {{question}}\nAnswer:", **fields}
        (folder / f"{name}.yaml").write_text(json.dumps(task))


async def afm_scores(url: str) -> dict[str, list[float]]:
    """Each choice's log-likelihood after its question, by afm's prompt scoring
    (``/v1/completions`` with ``echo``, ``logprobs`` and ``max_tokens`` 0) of
    the ids lm-eval sends: the context's and the continuation's, each
    tokenized alone."""
    out: dict[str, list[float]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        async def ids(text: str) -> list[int]:
            r = await h.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
            return list(r.json()["tokens"])

        for doc in DOCS:
            context = await ids(f"Question: {doc['question']}\nAnswer:")
            out[doc["question"]] = []
            for choice in doc["choices"]:
                tail = await ids(" " + choice)
                r = await h.post("/v1/completions", json={"prompt": context + tail, "echo": True, "logprobs": 1,
                                                          "max_tokens": 0})
                logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
                out[doc["question"]].append(sum(logprobs[-len(tail):]))
    return out


def installed_version() -> str:
    assert LM_EVAL is not None
    python = Path(LM_EVAL).resolve().parent / "python"
    out = __import__("subprocess").run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
        capture_output=True, text=True, check=False)
    return out.stdout.strip()


def test_lm_eval_version() -> None:
    version = installed_version()
    if version != VERSION:
        pytest.xfail(f"lm_eval {version} is installed; these tests were written against {VERSION}")


async def test_lm_eval_local_completions_with_its_defaults(random_model_dir: Path, tmp_path: Path) -> None:
    assert LM_EVAL is not None
    write_tasks(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    async with running_server(random_model_dir) as (url, engine):
        proc = await trio.run_process(
            [LM_EVAL, "--model", "local-completions",
             "--model_args", f"model=tiny,base_url={url}/v1/completions,num_concurrent=1",
             "--tasks", ",".join(TASKS), "--include_path", str(tmp_path),
             "--output_path", str(out), "--log_samples"],
            cwd=tmp_path, env=env, capture_stdout=True, capture_stderr=True, check=False)
        served = engine.statistics().requests_total
        scored = await afm_scores(url)
    log = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    assert "Using remote tokenizer backend" in log, log[-3000:]  # its default, offline
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= results["afm_choice"]["acc,none"] <= 1.0
    assert 0.0 <= results["afm_generate"]["exact_match,none"] <= 1.0
    samples = [json.loads(line) for f in out.rglob("samples_afm_choice_*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(samples) == len(DOCS)
    for sample, doc in zip(sorted(samples, key=lambda s: s["doc_id"]), DOCS, strict=True):
        scores = [float(resp[0][0]) for resp in sample["resps"]]  # one (log-likelihood, is_greedy) per choice
        assert len(scores) == len(doc["choices"]) and all(math.isfinite(s) and s < 0 for s in scores)
        # what afm's own prompt scoring gives the same token ids
        assert scores == pytest.approx(scored[doc["question"]], abs=1e-4)
    generated = [json.loads(line) for f in out.rglob("samples_afm_generate_*.jsonl")
                 for line in f.read_text().splitlines()]
    assert len(generated) == len(DOCS) and all("\n" not in s["resps"][0][0] for s in generated)
    # 5 choices scored and 2 generations (the probes and tokenizer calls are no generations)
    assert served == 5 + 2
