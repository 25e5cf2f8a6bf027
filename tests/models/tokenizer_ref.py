"""Tokenizer parity with llama.cpp: tiny vocabularies, GGUF files, the reference.

* :func:`tiny_cases` are GGUF tokenizer metadata of small vocabularies
  (stored in ``data/tokenizer_llamacpp.json``, trained once with the
  ``tokenizers`` and ``sentencepiece`` trainers), one per llama.cpp
  pre-tokenizer family and SentencePiece variant;
* :func:`write_gguf` writes a GGUF file with such a vocabulary and a tiny
  random llama (so llama.cpp can load it), with the ``gguf`` package's writer;
* :func:`llamacpp_tokenize` asks llama.cpp (``xllamacpp``'s in-process
  server, ``/tokenize`` with ``parse_special``) for token ids;
* :func:`pruned_vocab` keeps, of a real GGUF vocabulary, the entries a set of
  strings can reach (every token that is a substring of their pieces, every
  merge inside them, every special token they contain): the same ids for
  those strings, in a few kilobytes.

``python -m tests.models.tokenizer_ref`` (with ``xllamacpp`` installed and
the real GGUFs of ``AFM_REAL_GGUF_DIR``, default the fetcher's cache ``$AFM_HOME/downloads/real``) rewrites
the fixture's expected ids from llama.cpp and prints the parity counts.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .tokenizer_corpus import corpus


def fetched_dir() -> Path:
    """Where the real-GGUF fetcher (``afm testing fetch-real``) keeps the joined files."""
    from afm_core._models.default_model import afm_home

    return afm_home() / "downloads" / "real"

DATA = Path(__file__).parent / "data" / "tokenizer_llamacpp.json"
N_FIXTURE_STRINGS = 150  # the first strings of the corpus stored with expected ids

BPE_PRES = ("default", "llama-bpe", "qwen2", "qwen35", "smollm", "gpt-2", "falcon", "tekken",
            "gpt-4o", "seed-coder", "dbrx", "chatglm-bpe")  # fmt: skip
REAL_FILES = {
    "qwen2.5-coder": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "gemma-3": "gemma-3-270m-q4_k_m.gguf",
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
}
# Real vocabularies whose pruned slice is stored in the fixture: the Apache-2.0
# ones.  Gemma's terms of use cover its vocabulary too, so Gemma 3 is compared
# live only (test_live_real_gguf), never copied into the repository.
STORED_REAL = ("qwen2.5-coder", "smollm2")


def fixture_texts() -> list[str]:
    return corpus()[:N_FIXTURE_STRINGS]


# --- the tiny vocabularies ----------------------------------------------------

BPE_SPECIALS = [
    ("<|begin_of_text|>", 3), ("<|end_of_text|>", 3), ("<|eot_id|>", 3), ("<|eom_id|>", 3),
    ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4), ("</tool_call>", 4),
    ("<|fim_pad|>", 1), ("</s>", 1),
]  # fmt: skip
# Tokens no merge builds: only ignore_merges (llama-bpe, tekken) ever emits them.
BPE_UNMERGED = ["Ġxyzzy", "Ġunmergedword"]


def _train_bpe(texts: Sequence[str]) -> tuple[list[str], list[str]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts) * 3, trainer)
    state = json.loads(tok.to_str())
    vocab = sorted(state["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return [t for t, _ in vocab], merges


def _train_spm(texts: Sequence[str], tmp: Path) -> tuple[list[str], list[float], list[int]]:
    import sentencepiece as spm

    src = tmp / "spm.txt"
    src.write_text("\n".join(t.replace("\n", " ") for t in texts if t.strip()) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(src), model_prefix=str(tmp / "spm"), vocab_size=600, model_type="bpe",
        byte_fallback=True, character_coverage=0.98, split_digits=False,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "  ", "   "],
        minloglevel=2, num_threads=1,
    )  # fmt: skip
    proc = spm.SentencePieceProcessor(model_file=str(tmp / "spm.model"))
    tokens, scores, types = [], [], []
    for i in range(proc.get_piece_size()):
        tokens.append(proc.id_to_piece(i))
        scores.append(float(proc.get_score(i)))
        kind = 1
        if proc.is_unknown(i):
            kind = 2
        elif proc.is_control(i):
            kind = 3
        elif proc.is_byte(i):
            kind = 6
        elif proc.is_unused(i):
            kind = 5
        elif tokens[-1] in ("<start_of_turn>", "<end_of_turn>", "  ", "   "):
            kind = 3 if tokens[-1].startswith("<") else 4
        types.append(kind)
    return tokens, scores, types


def train_vocabularies(tmp: Path) -> dict[str, Any]:
    """Train the tiny vocabularies (deterministic; run once, stored in the fixture)."""
    texts = corpus()
    tokens, merges = _train_bpe(texts)
    specials = [t for t, _ in BPE_SPECIALS]
    tokens = [t for t in tokens if t not in specials and t not in BPE_UNMERGED]
    types = [1] * len(tokens)
    tokens += specials + BPE_UNMERGED
    types += [k for _, k in BPE_SPECIALS] + [1] * len(BPE_UNMERGED)
    spm_tokens, spm_scores, spm_types = _train_spm(texts, tmp)
    return {
        "bpe": {"tokens": tokens, "types": types, "merges": merges},
        "spm": {"tokens": spm_tokens, "scores": spm_scores, "types": spm_types},
    }


def tiny_cases(vocabs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """GGUF tokenizer metadata per case name (``bpe-<pre>``, ``spm-prefix``, ``spm-noprefix``)."""
    cases: dict[str, dict[str, Any]] = {}
    bpe = vocabs["bpe"]
    ids = {t: i for i, t in enumerate(bpe["tokens"])}
    for pre in BPE_PRES:
        cases[f"bpe-{pre}"] = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": list(bpe["tokens"]),
            "tokenizer.ggml.token_type": list(bpe["types"]),
            "tokenizer.ggml.merges": list(bpe["merges"]),
            "tokenizer.ggml.bos_token_id": ids["<|begin_of_text|>"],
            "tokenizer.ggml.eos_token_id": ids["<|end_of_text|>"],
        }
    spm = vocabs["spm"]
    for name, prefix in (("spm-prefix", True), ("spm-noprefix", False)):
        cases[name] = {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": list(spm["tokens"]),
            "tokenizer.ggml.token_type": list(spm["types"]),
            "tokenizer.ggml.scores": list(spm["scores"]),
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_space_prefix": prefix,
        }
    return cases


# --- GGUF files for llama.cpp ---------------------------------------------------


def write_gguf(path: Path, meta: Mapping[str, Any]) -> Path:
    """A tiny random llama with ``meta``'s vocabulary (llama.cpp loads it)."""
    import gguf

    n_vocab, dim, ff = len(meta["tokenizer.ggml.tokens"]), 32, 64
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(dim // 2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # all F32
    if "tokenizer.chat_template" in meta:
        w.add_chat_template(meta["tokenizer.chat_template"])
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    for key in ("bos", "eos", "unknown", "padding"):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            getattr(w, {"bos": "add_bos_token_id", "eos": "add_eos_token_id",
                        "unknown": "add_unk_token_id", "padding": "add_pad_token_id"}[key])(
                int(meta[f"tokenizer.ggml.{key}_token_id"]))  # fmt: skip
    for key, fn in (("add_space_prefix", w.add_add_space_prefix), ("add_bos_token", w.add_add_bos_token),
                    ("add_eos_token", w.add_add_eos_token)):  # fmt: skip
        if f"tokenizer.ggml.{key}" in meta:
            fn(bool(meta[f"tokenizer.ggml.{key}"]))
    rng = np.random.default_rng(0)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (0.02 * rng.standard_normal(shape)).astype(np.float32))

    t("token_embd.weight", n_vocab, dim)
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    t("output.weight", n_vocab, dim)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(dim, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(dim, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        t(f"blk.0.{name}.weight", dim, dim)
    t("blk.0.ffn_gate.weight", ff, dim)
    t("blk.0.ffn_up.weight", ff, dim)
    t("blk.0.ffn_down.weight", dim, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llamacpp_tokenize(gguf_path: Path | str, texts: Iterable[str]) -> list[list[int]]:
    """llama.cpp's ids for ``texts`` (``add_special`` and ``parse_special`` on)."""
    import xllamacpp as xl

    params = xl.CommonParams()
    params.model.path = str(gguf_path)
    params.n_ctx = 256
    params.n_parallel = 1
    params.warmup = False
    params.cpuparams.n_threads = 1
    server = xl.Server(params)
    addr = server.listening_address
    out = []
    try:
        for text in texts:
            body = json.dumps({"content": text, "add_special": True, "parse_special": True})
            req = urllib.request.Request(addr + "/tokenize", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                out.append([int(i) for i in json.loads(resp.read())["tokens"]])
    finally:
        del server
    return out


# --- pruned real vocabularies -----------------------------------------------------


def _substrings(words: Iterable[str], max_len: int) -> set[str]:
    subs: set[str] = set()
    for word in words:
        for i in range(len(word)):
            for j in range(i + 1, min(len(word), i + max_len) + 1):
                subs.add(word[i:j])
    return subs


def pruned_vocab(metadata: Mapping[str, Any], texts: Sequence[str]) -> dict[str, Any]:
    """A small GGUF tokenizer metadata that tokenizes ``texts`` like the full one.

    Keeps every special token found in the texts (and the ones the loader
    looks up by text), every entry that is a substring of the texts (as the
    vocabulary spells them: byte-level characters, or U+2581 for spaces),
    the byte tokens, and the merges among the kept entries, in their
    order.  ``"ids"`` maps the kept entries to their ids in the full file.
    """
    from afm_core._models.gguf.tokenizer import _bpe_merges  # noqa: F401 (same split rule)
    from afm_core._models.gguf.vocab import read_vocab

    full = read_vocab(metadata)
    raw_types = metadata.get("tokenizer.ggml.token_type")
    tokens, types = full.tokens, [] if raw_types is None else [int(t) for t in raw_types]
    if full.kind == "gpt2":
        from tokenizers.pre_tokenizers import ByteLevel

        byte_map = ByteLevel(add_prefix_space=False, use_regex=False)
        words = [p for t in texts for p, _ in byte_map.pre_tokenize_str(t)]
    else:
        words = [t.replace(" ", "\u2581") for t in texts] + ["\u2581" + t.replace(" ", "\u2581") for t in texts]
    longest = max(len(t) for t in tokens)
    subs = _substrings(words, longest)
    joined = "\x00".join(texts)
    keep = set()
    for i, tok in enumerate(tokens):
        special = full.types[i] in (2, 3, 4)
        if (special and (tok in joined or i in full.special_ids.values() or i in full.eog_ids)) or (
            not special and (tok in subs or (types and types[i] == 6))
        ):
            keep.add(i)
    kept = sorted(keep)
    meta = {k: v for k, v in metadata.items() if k.startswith("tokenizer.") and not isinstance(v, list | np.ndarray)}
    meta = {k: v for k, v in meta.items() if not k.endswith("_token_id") and k != "tokenizer.chat_template"}
    new_id = {old: new for new, old in enumerate(kept)}
    meta["tokenizer.ggml.tokens"] = [tokens[i] for i in kept]
    if types:
        meta["tokenizer.ggml.token_type"] = [int(types[i]) for i in kept]
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is not None:
        meta["tokenizer.ggml.scores"] = [float(scores[i]) for i in kept]
    for key in ("bos", "eos", "unknown", "padding"):
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and int(value) in new_id:
            meta[f"tokenizer.ggml.{key}_token_id"] = new_id[int(value)]
    if full.kind == "gpt2":
        kept_text = set(meta["tokenizer.ggml.tokens"])
        merges = []
        for entry in full.merges:
            pos = entry.find(" ", 1)
            a, b = entry[:pos], entry[pos + 1 :]
            if a in kept_text and b in kept_text and a + b in kept_text:
                merges.append(entry)
        meta["tokenizer.ggml.merges"] = merges
    meta["general.name"] = str(metadata.get("general.name", ""))
    return {"metadata": meta, "ids": kept}


# --- the fixture -----------------------------------------------------------------------


def _read_metadata(path: Path) -> dict[str, Any]:
    from afm_core._models.gguf.reader import read_gguf_info

    return dict(read_gguf_info(path).metadata)


def main(argv: Sequence[str]) -> int:
    import os
    import tempfile

    real_dir = Path(os.environ.get("AFM_REAL_GGUF_DIR") or fetched_dir())
    texts = fixture_texts()
    fixture = json.loads(DATA.read_text()) if DATA.exists() and "--retrain" not in argv else {}
    with tempfile.TemporaryDirectory() as tmp:
        if "vocabs" not in fixture:
            fixture["vocabs"] = train_vocabularies(Path(tmp))
        expected: dict[str, list[str]] = {}
        for name, meta in tiny_cases(fixture["vocabs"]).items():
            ids = llamacpp_tokenize(write_gguf(Path(tmp) / f"{name}.gguf", meta), texts)
            expected[name] = [" ".join(map(str, x)) for x in ids]
            print(f"{name}: {len(ids)} strings from llama.cpp", file=sys.stderr)
        real: dict[str, Any] = {}
        for name, file in REAL_FILES.items():
            if name not in STORED_REAL:
                continue
            path = real_dir / file
            if not path.exists():
                path = Path.home() / ".cache" / "afm" / "downloads" / file
            if not path.exists():
                print(f"{name}: {file} not found, kept as it was", file=sys.stderr)
                if name in fixture.get("real", {}):
                    real[name] = fixture["real"][name]
                continue
            ids = llamacpp_tokenize(path, texts)
            pruned = pruned_vocab(_read_metadata(path), texts)
            real[name] = {**pruned, "expected": [" ".join(map(str, x)) for x in ids]}
            print(f"{name}: {len(pruned['ids'])} entries kept", file=sys.stderr)
    fixture["expected"] = expected
    fixture["real"] = real
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(fixture, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {DATA} ({DATA.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
