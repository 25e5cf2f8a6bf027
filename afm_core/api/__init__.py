"""Wire APIs as sans-IO translations, public for host code.

Each API is a parser and a writer over the one engine: its request JSON into
the engine's request (a :class:`~afm_core.ChatRequest`, whose native form is
OpenAI's chat body, :mod:`.chat_request`; or a raw-prompt
:class:`~afm_core.CompletionRequest`, :mod:`.completions_request`), validated
with that API's own errors; and the engine's events (one stream per choice)
into that API's frames and final object through a ``Writer`` with the one
interface of :mod:`.writer`.  The modules: :mod:`.chat` (Chat Completions),
:mod:`.completions` (legacy Completions), :mod:`.anthropic` (Messages),
:mod:`.responses` (Responses), :mod:`.ollama` (Ollama's ``/api/*``);
:mod:`.embeddings` and :mod:`.tokenize` generate nothing and have no writer.
They share the engine, the stream core, the tool-call tracker, structured
output and the SSE encoder; none generates anything itself.  ``afm_http``
serves them with one driver; an application embedding the engine can use the
same translations::

    from afm_core.api import chat
    request = chat.parse(body)                           # raises RequestError
    async with engine.stream(request) as stream:
        writer = chat.Writer(id=stream.id, created=stream.created, model=stream.model)
        async for batch in stream.batches():
            sse = writer.feed(0, batch)                  # chat.completion.chunk frames
        sse = writer.end()                               # data: [DONE]

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard
library.  Never mlx, trio, the engine or HTTP code (import-linter checks it).
"""
