"""``afm bench --real-model`` against llama.cpp's own server loop on a tiny
GGUF that both load (a random llama with a trained byte-level BPE
vocabulary, written with ``tests/models/gguf_writer.py``).  Opt-in: skipped
unless ``xllamacpp`` (the prebuilt llama.cpp, ``afm[bench-llamacpp]``) is
installed.  Checks the layout and bookkeeping, never the numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afm_core.bench._llamacpp import xllamacpp_unavailable
from tests.models import gguf_writer as gw

pytestmark = pytest.mark.skipif(xllamacpp_unavailable() is not None,
                                reason=f"the llama.cpp peer is absent: {xllamacpp_unavailable()}")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONFIG: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                          "rope_theta": 10000.0, "max_position_embeddings": 1024}


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from afm_core.bench._prompts import code_files

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text for _, text in code_files()[:3]], trainer)
    return tok


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    tok = _tokenizer()
    config = {**CONFIG, "model_type": "llama", "vocab_size": tok.get_vocab_size(),
              "tie_word_embeddings": False}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    state = json.loads(tok.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    meta = {**gw.llama_metadata(config),
            # "gpt-2": GPT-2's split, as the trained tokenizer's ByteLevel does (llama.cpp's
            # "default" splits otherwise, and the two would count other prompt lengths)
            **gw.bpe_metadata(tok.get_vocab(), merges, special=SPECIALS, pre="gpt-2",
                              bos="<|im_start|>", eos="<|im_end|>", chat_template=TEMPLATE)}
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return gw.write_gguf(path, meta, gw.llama_tensors(weights, config, "Q8_0"))


def test_against_llamacpp_on_a_tiny_gguf(tiny_gguf: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from afm_core._cli import main

    monkeypatch.setenv("AFM_HOME", str(tmp_path / "home"))  # afm converts the file there
    out = tmp_path / "real"
    rc = main(["bench", "--real-model", "--gguf", str(tiny_gguf), "--targets", "ours,llamacpp",
               "--rounds", "2", "--decode-tokens", "8", "--decode-requests", "1",
               "--batch-requests", "8", "--batch-tokens", "4", "--ttft-lengths", "200,100000",
               "--threads", "2", "--out", str(out)])
    assert rc == 0
    m = json.loads((out / "report.json").read_text())["models"][0]
    assert m["targets"] == ["ours", "llama.cpp"] and not m["skipped"]
    assert m["model"]["context"] == 1024 and m["llamacpp_n_ctx"] <= 1024
    for ph in m["phases"]:  # llama.cpp ran every phase, the 8-stream one included
        for t in ("ours", "llama.cpp"):
            assert ph["by_target"][t]["ok"] == ph["by_target"][t]["requests"] > 0, (ph["name"], t)
    # both servers saw the same prompts: the same template on the same vocabulary
    assert not m["notes"], m["notes"]
    llama = m["servers"]["llama.cpp"]
    assert llama["isa"] and llama["threads"] == 2 and llama["peak_rss_bytes"] > 0
    assert llama["xllamacpp"]
    vs = m["headline"]["ours"]["vs_llama.cpp"]
    for col in m["columns"]:
        assert vs[col["key"]] is not None, col["key"]
    assert len(vs["decode_tok_s_by_round"]) == 2 and len(vs["ttft_200_ms_by_round"]) == 2
    assert "x" in (out / "report.txt").read_text()
