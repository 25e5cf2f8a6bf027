"""The engine's tokenizer-side work, run in a preparation lane (:mod:`.lanes`)
with a ``check`` between pieces: the requests' cost, the texts and ids of
``Engine.embed``, the tokenizer's description, each token's bytes.  No MLX."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import ContextLengthError, RequestError
from .._mlx.tokenizer import encode
from ..api.chat_request import ChatRequest
from ..api.completions_request import CompletionRequest
from .lanes import Ticket, text_cost

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .._models.loader import ModelInfo
    from .._stream.detok import DecoderTables


def as_request(request: object) -> ChatRequest | CompletionRequest:
    """``request`` as an engine request: an OpenAI-style chat dict is validated
    (:class:`RequestError` when it is not a valid body)."""
    if isinstance(request, ChatRequest | CompletionRequest):
        return request
    if isinstance(request, dict):
        return ChatRequest.from_openai(request)
    raise TypeError("request must be a ChatRequest or an OpenAI-style dict (or a CompletionRequest), "
                    f"not {type(request).__name__}")


def request_cost(request: ChatRequest | CompletionRequest) -> int:
    """What preparing ``request`` costs, in characters (:func:`.lanes.text_cost`):
    its messages, tools and schema, or its raw prompt."""
    if isinstance(request, CompletionRequest):
        return text_cost(request.prompt) + text_cost(request.suffix or "")
    return text_cost(request.messages) + text_cost(request.tools or ()) + text_cost(request.response_format or {})


def embedding_items(inputs: object) -> list[str | list[int]]:
    """``Engine.embed``'s ``inputs`` as a list of texts and token-id lists."""
    if isinstance(inputs, str):
        return [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, bytes | bytearray):
        raise RequestError("input must be a string, a list of strings, a list of token ids "
                           "or a list of token-id lists", param="input")
    if not inputs:
        raise RequestError("input must not be empty", param="input")
    if all(isinstance(i, int) and not isinstance(i, bool) for i in inputs):
        return [list(inputs)]
    items: list[str | list[int]] = []
    for n, item in enumerate(inputs):
        if isinstance(item, str):
            items.append(item)
        elif isinstance(item, Sequence) and not isinstance(item, bytes | bytearray):
            items.append(list(item))
        else:
            raise RequestError("each input must be a string or a list of token ids",
                               param=f"input[{n}]")
    return items


def embedding_token_lists(items: list[str | list[int]], tokenizer: TokenizerWrapper, info: ModelInfo,
                          limit: int, ticket: Ticket) -> list[tuple[int, ...]]:
    """Each input's token ids: a text tokenized as the tokenizer does by
    default, a list of ids checked against ``limit`` (the vocabulary); an
    empty input or one longer than the context is the caller's error."""
    out = []
    for n, item in enumerate(items):
        ticket.check()
        param = "input" if len(items) == 1 else f"input[{n}]"
        if isinstance(item, str):
            ids = tuple(encode(tokenizer, item, add_special_tokens=True, check=ticket.check))
        else:
            for i in item:
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < limit:
                    raise RequestError(f"token id {i!r} is not in the model's vocabulary "
                                       f"(0-{limit - 1})", param=param)
            ids = tuple(item)
        if not ids:
            raise RequestError("an input must not be empty", param=param)
        if len(ids) > info.context_length:
            raise ContextLengthError(
                f"input has {len(ids)} tokens, more than the model's context length "
                f"({info.context_length})", param=param)
        out.append(ids)
    return out


def tokenizer_info(tokenizer: TokenizerWrapper, info: ModelInfo) -> dict[str, Any]:
    """See :meth:`Engine.tokenizer_info <.engine.Engine.tokenizer_info>`."""
    from .._mlx.tokenizer import hf_tokenizer

    hf = hf_tokenizer(tokenizer)
    out: dict[str, Any] = {}
    for key, value in (getattr(hf, "init_kwargs", None) or {}).items():
        if key.endswith(("_file", "_path")) or key in ("name_or_path", "chat_template"):
            continue
        if value is None or isinstance(value, (str, int, float, bool)):
            out[key] = value
        elif isinstance(getattr(value, "content", None), str):  # an AddedToken
            out[key] = value.content
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(hf, key, None)
        out[key] = value if isinstance(value, str) else None
    out.update(tokenizer_class=type(hf).__name__, model_max_length=info.context_length,
               chat_template=info.chat_template)
    return out


def token_pieces(ids: list[int], tokenizer: TokenizerWrapper, tables: DecoderTables,
                 ticket: Ticket) -> list[bytes]:
    """Each token's own bytes (a special token's spelling; see
    :meth:`Engine.token_pieces <.engine.Engine.token_pieces>`)."""
    from .._stream.detok_tables import BYTE, RAW, TEXT

    def piece(i: int) -> bytes:
        kind = tables.kinds[i] if i < len(tables.kinds) else None
        if kind == BYTE:
            return bytes((tables.bytevals[i],))
        if kind == RAW:  # (byte_level: a TEXT token's bytes are its text's UTF-8, below)
            raw = tables.raws[i]
            assert raw is not None
            return raw
        if kind == TEXT:
            text = tables.texts[i]
            assert text is not None
            return text.encode("utf-8")
        # a special token (the tables skip them)
        return str(tokenizer.convert_ids_to_tokens(i) or "").encode("utf-8")

    out = []
    for n, i in enumerate(ids):
        if n % 4096 == 0:
            ticket.check()
        out.append(piece(i))
    return out
