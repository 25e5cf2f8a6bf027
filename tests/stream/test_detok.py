"""Incremental detokenizer: oracle is the tokenizer's own ``decode``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afm_core._errors import UnsupportedDecoderError
from afm_core._stream.detok_tables import DecoderTables
from tests.stream import tokenizers as toks
from tests.stream.helpers import PY, C, TwinSet

TOKENIZERS: dict[str, Callable[[], Any]] = {
    "byte_level": toks.byte_level,
    "byte_level_256": lambda: toks.byte_level(256),
    "spm_llama": toks.sentencepiece,
    "spm_metaspace_bf": lambda: toks.sentencepiece(toks.METASPACE_BF_DECODER),
    "spm_metaspace": lambda: toks.sentencepiece(toks.METASPACE_DECODER),
}

SAMPLES = [
    toks.CORPUS,
    "今天天气很好，東京は日本の首都です。한국어",
    "Emoji 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷 heart ❤️",
    "  two leading spaces and trailing  ",
    " <think>reason</think>answer<|im_end|>",
    "hello world café naïve — “quotes”",
    "",
]

_cache: dict[tuple[str, bool], tuple[Any, DecoderTables]] = {}


def load(name: str, skip: bool = True) -> tuple[Any, DecoderTables]:
    key = (name, skip)
    if key not in _cache:
        tok = TOKENIZERS[name]()
        _cache[key] = (tok, DecoderTables.from_tokenizer(tok, skip_special_tokens=skip))
    return _cache[key]


def stream(twin: TwinSet, tables: DecoderTables, ids: list[int]) -> tuple[list[str], str]:
    d = twin.detok.IncrementalDetokenizer(tables)
    deltas = [d.feed(i) for i in ids]
    return deltas, d.flush()


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_every_prefix_matches_decode(twin: TwinSet, name: str, skip: bool) -> None:
    tok, tables = load(name, skip)
    for text in SAMPLES:
        ids = tok.encode(text).ids
        for k in range(len(ids) + 1):
            deltas, rest = stream(twin, tables, ids[:k])
            assert "".join(deltas) + rest == tok.decode(ids[:k], skip_special_tokens=skip)


def test_samples_really_split_characters() -> None:
    tok, _ = load("byte_level_256")
    assert len(tok.encode("中").ids) == 3
    spm, _ = load("spm_llama")
    assert "<0xE4>" in spm.encode("中").tokens


@pytest.mark.parametrize("name", ["byte_level", "byte_level_256"])
def test_byte_level_holds_back_only_incomplete_utf8(twin: TwinSet, name: str) -> None:
    tok, tables = load(name)
    ids = tok.encode("a中b").ids
    d = twin.detok.IncrementalDetokenizer(tables)
    out = [d.feed(i) for i in ids]
    assert "".join(out) == "a中b"
    # Each delta is emitted as soon as its characters are complete.
    text = ""
    for k, piece in enumerate(out):
        text += piece
        assert tok.decode(ids[: k + 1]).rstrip("\ufffd") == text


def test_byte_level_invalid_bytes_become_replacement(twin: TwinSet) -> None:
    tok, tables = load("byte_level_256")
    vocab = tok.get_vocab()
    mapping = {v: k for k, v in toks_byte_map().items()}
    ids = [vocab[mapping[b]] for b in b"\xe4\xb8A\xff\xf0\x9f\x98"]
    deltas, rest = stream(twin, tables, ids)
    assert deltas[2] == "\ufffdA" and deltas[3] == "\ufffd"
    assert "".join(deltas) + rest == tok.decode(ids) == "\ufffdA\ufffd\ufffd"


def test_byte_level_tables_keep_bytes_only_for_raw_tokens() -> None:
    """A TEXT token's bytes are its text's UTF-8 (the detokenizers encode it
    when it follows held-back bytes, as above), so only RAW ids keep bytes."""
    from afm_core._stream.detok_tables import RAW, TEXT

    _, tables = load("byte_level_256")
    kinds = list(tables.kinds)
    assert RAW in kinds and TEXT in kinds
    assert [raw is not None for raw in tables.raws] == [k == RAW for k in kinds]


def toks_byte_map() -> dict[str, int]:
    from afm_core._stream.detok_tables import byte_decoder

    return byte_decoder()


def test_spm_byte_run_is_held_until_a_text_token(twin: TwinSet) -> None:
    tok, tables = load("spm_llama")
    ids = tok.encode("a 中文 b").ids
    d = twin.detok.IncrementalDetokenizer(tables)
    out = [d.feed(i) for i in ids]
    pieces = tok.encode("a 中文 b").tokens
    byte_positions = [k for k, t in enumerate(pieces) if t.startswith("<0x")]
    assert byte_positions and all(out[k] == "" for k in byte_positions)
    assert "".join(out) + d.flush() == "a 中文 b"


def test_spm_strip_applies_once_at_start(twin: TwinSet) -> None:
    tok, tables = load("spm_llama")
    ids = tok.encode("x").ids
    spaces = [tok.token_to_id("▁")] * 2
    for seq in (spaces + ids, ids + spaces + ids, spaces):
        deltas, rest = stream(twin, tables, seq)
        assert "".join(deltas) + rest == tok.decode(seq)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_skip_special_tokens(twin: TwinSet, name: str) -> None:
    tok, _ = load(name)
    ids = tok.encode("<|im_start|><think>x</think>y<|im_end|>").ids
    kept = "".join(stream(twin, load(name, False)[1], ids)[0])
    skipped = "".join(stream(twin, load(name, True)[1], ids)[0])
    assert "<|im_end|>" in kept and "<|im_start|>" in kept
    assert "<|im_end|>" not in skipped and "<|im_start|>" not in skipped
    assert "<think>" in skipped and "</think>" in skipped


def test_unknown_ids_are_dropped_like_decode(twin: TwinSet) -> None:
    tok, tables = load("byte_level")
    ids = [*tok.encode("ab").ids, 10**6, -1]
    deltas, rest = stream(twin, tables, ids)
    assert "".join(deltas) + rest == "ab"


def test_reset_and_feed_many(twin: TwinSet) -> None:
    tok, tables = load("spm_llama")
    ids = tok.encode(" x 中").ids
    d = twin.detok.IncrementalDetokenizer(tables)
    first = d.feed_many(ids) + d.flush()
    d.reset()
    assert d.feed_many(ids) + d.flush() == first == tok.decode(ids)


def test_accepts_hf_and_mlx_lm_tokenizers(twin: TwinSet) -> None:
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    for make in (toks.byte_level, toks.sentencepiece):
        hf = PreTrainedTokenizerFast(tokenizer_object=make(), eos_token="<|im_end|>")
        ids = hf.encode("héllo 中文 <think>😀</think>", add_special_tokens=False)
        for obj in (hf, TokenizerWrapper(hf)):
            d = twin.detok.IncrementalDetokenizer(obj, skip_special_tokens=False)
            want = hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            assert d.feed_many(ids) + d.flush() == want


def test_unsupported_decoders_raise() -> None:
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(UnsupportedDecoderError, match="no decoder"):
        DecoderTables.from_tokenizer(tok)
    tok.decoder = decoders.WordPiece()
    with pytest.raises(UnsupportedDecoderError, match="WordPiece"):
        DecoderTables.from_tokenizer(tok)
    with pytest.raises(UnsupportedDecoderError, match="backend"):
        DecoderTables.from_tokenizer(object())
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Replace("▁", " ")])
    with pytest.raises(UnsupportedDecoderError):
        DecoderTables.from_tokenizer(tok)


# -- differential + oracle over random ids ---------------------------------


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(TOKENIZERS)),
    skip=st.booleans(),
    picks=st.lists(st.integers(min_value=0, max_value=10**6), max_size=24),
)
def test_random_ids_twins_agree_with_decode(name: str, skip: bool, picks: list[int]) -> None:
    tok, tables = load(name, skip)
    size = len(tables.kinds)
    ids = [p % (size + 2) for p in picks]  # includes a couple of unknown ids
    c, py = stream(C, tables, ids), stream(PY, tables, ids)
    assert c == py
    assert "".join(c[0]) + c[1] == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(sorted(TOKENIZERS)), text=st.text(max_size=40))
def test_random_text_roundtrip(name: str, text: str) -> None:
    tok, tables = load(name)
    ids = tok.encode(text).ids
    c, py = stream(C, tables, ids), stream(PY, tables, ids)
    assert c == py
    assert "".join(c[0]) + c[1] == tok.decode(ids)
