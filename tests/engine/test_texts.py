"""The engine's tokenizer-side work (``afm_core._engine.texts``) on its own,
with the random tiny model's real tokenizer from ``afm_core.testing``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from afm_core import ChatRequest, CompletionRequest, ContextLengthError, RequestError
from afm_core._engine.lanes import Abandoned, Ticket
from afm_core._engine.texts import (
    as_request,
    embedding_items,
    embedding_token_lists,
    request_cost,
    token_pieces,
    tokenizer_info,
)
from afm_core._models.loader import load
from afm_core._stream.detok import DecoderTables


@pytest.fixture(scope="module")
def loaded(random_model_dir: Path) -> tuple[Any, Any]:
    _, tokenizer, info = load(random_model_dir)
    return tokenizer, info


def test_requests_from_dicts_and_their_cost() -> None:
    chat = as_request({"messages": [{"role": "user", "content": "hello there"}]})
    assert isinstance(chat, ChatRequest) and as_request(chat) is chat
    with pytest.raises(TypeError, match="ChatRequest"):
        as_request("hello")
    with pytest.raises(RequestError):
        as_request({"messages": "no"})
    longer = as_request({"messages": [{"role": "user", "content": "hello there" * 100}]})
    assert 0 < request_cost(chat) < request_cost(longer)
    raw = CompletionRequest.from_openai({}, "x" * 50)
    assert request_cost(raw) >= 50


def test_embedding_inputs_in_every_shape() -> None:
    assert embedding_items("a") == ["a"]
    assert embedding_items([1, 2]) == [[1, 2]]
    assert embedding_items(["a", [3], (4, 5)]) == ["a", [3], [4, 5]]
    for bad, param in (([], "input"), (b"x", "input"), (5, "input"), (["a", 3.5], "input[1]")):
        with pytest.raises(RequestError) as err:
            embedding_items(bad)
        assert err.value.param == param


def test_embedding_token_lists_check_each_input(loaded: tuple[Any, Any]) -> None:
    tokenizer, info = loaded
    limit = min(info.vocab_size, len(tokenizer))
    lists = embedding_token_lists(["hello world", [1, 2, 3]], tokenizer, info, limit, Ticket())
    assert lists[0] == tuple(tokenizer.encode("hello world")) and lists[1] == (1, 2, 3)
    with pytest.raises(RequestError, match="vocabulary") as err:
        embedding_token_lists([[1], [limit]], tokenizer, info, limit, Ticket())
    assert err.value.param == "input[1]"
    with pytest.raises(RequestError, match="empty"):
        embedding_token_lists([[]], tokenizer, info, limit, Ticket())
    with pytest.raises(ContextLengthError):
        embedding_token_lists([[1] * (info.context_length + 1)], tokenizer, info, limit, Ticket())
    gone = Ticket()
    gone.cancel()
    with pytest.raises(Abandoned):
        embedding_token_lists(["hello"], tokenizer, info, limit, gone)


def test_token_pieces_join_into_the_text(loaded: tuple[Any, Any]) -> None:
    tokenizer, _ = loaded
    tables = DecoderTables.from_tokenizer(tokenizer)
    text = "héllo wörld, 日本"
    ids = list(tokenizer.encode(text))
    pieces = token_pieces(ids, tokenizer, tables, Ticket())
    assert len(pieces) == len(ids) and b"".join(pieces).decode("utf-8") == tokenizer.decode(ids)
    special = sorted(tokenizer.eos_token_ids)[0]
    assert token_pieces([special], tokenizer, tables, Ticket()) == \
        [tokenizer.convert_ids_to_tokens(special).encode("utf-8")]


def test_tokenizer_info_describes_without_paths(loaded: tuple[Any, Any]) -> None:
    tokenizer, info = loaded
    out = tokenizer_info(tokenizer, info)
    assert out["model_max_length"] == info.context_length
    assert out["chat_template"] == info.chat_template
    assert out["tokenizer_class"] and "eos_token" in out
    assert not any(k.endswith(("_file", "_path")) for k in out) and "name_or_path" not in out
