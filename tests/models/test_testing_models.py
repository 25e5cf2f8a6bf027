"""The offline test models load with mlx-lm and behave as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest
from mlx_lm.generate import batch_generate

ECHO_TEXTS = [
    "a",
    "Hello, world!",
    "Ünïcödé, 東京は日本の首都です。 emoji 😀🚀👍🏽🇫🇷 and Привет",
    "  leading and trailing spaces, tabs\tand\nnew\n\nlines  ",
    "<think>inner reasoning</think> then <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>",
    "```json\n{\"ok\": true}\n```",
    "a longer text " * 40,
]


@pytest.fixture(scope="module")
def echo(echo_model_dir: Path):
    return mlx_lm.load(str(echo_model_dir))


def _prompt(tokenizer, text: str, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, **kwargs
    )


def test_model_directories_are_complete(echo_model_dir: Path, random_model_dir: Path) -> None:
    for d in (echo_model_dir, random_model_dir):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (d / name).is_file(), name
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        assert "<|im_start|>" in cfg["chat_template"]


def test_tokenizer_has_chat_special_tokens(random_model_dir: Path) -> None:
    _, tok = mlx_lm.load(str(random_model_dir))
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, t
    assert tok.eos_token == "<|im_end|>"
    # <think> survives skip_special_tokens (like Qwen's), <|im_end|> does not
    ids = tok.encode("<think>x</think><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_chat_template_renders_tools_calls_and_thinking(random_model_dir: Path) -> None:
    _, tok = mlx_lm.load(str(random_model_dir))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in text and '"get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n21C\n</tool_response>" in text
    assert "weather?" in text
    assert text.endswith("<|im_start|>assistant\n")
    off = tok.apply_chat_template(
        messages[:2], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_random_model_generates(random_model_dir: Path) -> None:
    model, tok = mlx_lm.load(str(random_model_dir))
    out = mlx_lm.generate(model, tok, _prompt(tok, "hi"), max_tokens=8)
    assert isinstance(out, str)
    cfg = json.loads((random_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["torch_dtype"] == "float32"


def test_random_model_options(tmp_path: Path) -> None:
    from afm_core.testing import make_random_model

    d = make_random_model(tmp_path / "big", vocab_size=2048, hidden_size=128, num_layers=3, num_heads=8)
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (2048, 128, 3)
    model, _ = mlx_lm.load(str(d))
    assert len(model.layers) == 3


def test_visible_text_model_streams_printable_varied_text(tmp_path: Path) -> None:
    """A plain random model's greedy output soon repeats one token (often a
    newline); ``visible_text`` gives printable, varied text, the same for a
    prompt alone and in a batch."""
    from afm_core.testing import make_random_model

    d = make_random_model(tmp_path / "vis", visible_text=True)
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is False
    model, tok = mlx_lm.load(str(d))
    prompts = [_prompt(tok, w) for w in ("hi", "Summarize the following notes. river cache", "x y z")]
    texts = []
    for p in prompts:
        ids = [r.token for r in mlx_lm.stream_generate(model, tok, p, max_tokens=48)]
        text = tok.decode(ids)
        assert len(ids) == 48 and text.strip() and text.isprintable(), repr(text)
        assert len(set(ids)) >= 8, ids  # not one token repeated
        assert "<" not in text and ">" not in text  # no markup a parser would read
        texts.append(text)
    batched = batch_generate(model, tok, prompts,
                             max_tokens=48).texts
    assert batched == texts


def _echo_ids(model, tok, prompt) -> list[int]:
    ids = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=1000)]
    assert ids[-1] in tok.eos_token_ids
    return ids[:-1]


@pytest.mark.parametrize("text", ECHO_TEXTS)
def test_echo_reproduces_text(echo, text: str) -> None:
    model, tok = echo
    # tokenizer.decode is the oracle: mlx-lm's own streaming detokenizer trims
    # one leading space from a completion.
    assert tok.decode(_echo_ids(model, tok, _prompt(tok, text))) == text


def test_echo_with_thinking_disabled_and_history(echo) -> None:
    model, tok = echo
    msgs = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"},
    ]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
    assert tok.decode(_echo_ids(model, tok, prompt)) == "second question"


def test_echo_stops_with_eos(echo) -> None:
    model, tok = echo
    prompt = _prompt(tok, "short")
    tokens = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=50)]
    assert tokens[-1] in tok.eos_token_ids
    assert len(tokens) == len(tok.encode("short", add_special_tokens=False)) + 1


def test_echo_batch_of_prompts(echo) -> None:
    model, tok = echo
    prompts = [_prompt(tok, t) for t in ECHO_TEXTS]
    result = batch_generate(model, tok, prompts, max_tokens=1000, return_token_ids=True)
    texts = [tok.decode([t for t in ids if t not in tok.eos_token_ids]) for ids in result.token_ids]
    assert texts == ECHO_TEXTS


def test_cli_make_model(tmp_path: Path) -> None:
    for extra in ([], ["--echo"], ["--visible-text"]):
        out = tmp_path / (extra[0].strip("-") if extra else "rand")
        proc = subprocess.run(
            [sys.executable, "-m", "afm_core._cli", "testing", "make-model", str(out), *extra],
            capture_output=True, text=True, check=True,
        )
        assert proc.stdout.strip() == str(out)
        mlx_lm.load(str(out))


def test_afm_load_keeps_the_wrappers_detokenizer_working(echo_model_dir: Path) -> None:
    """afm's loader swaps mlx-lm's table-building streaming detokenizer for
    its naive one (afm has its own tables); host code asking the wrapper for
    ``detokenizer`` still gets every text right."""
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

    from afm_core._models.loader import load

    _, tok, _ = load(echo_model_dir)
    for text in ECHO_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        detok = tok.detokenizer
        assert isinstance(detok, NaiveStreamingDetokenizer)
        for i in ids:
            detok.add_token(i)
        detok.finalize()
        assert detok.text == tok.decode(ids)
