"""Wire APIs as sans-IO translations, public for host code.

Each module translates one API (Anthropic Messages, OpenAI Responses, the
legacy Completions, Embeddings) to the engine and back: its request JSON into the
engine's request (validated, with that API's own errors), and the engine's
events into that API's objects and SSE frames.  They share the engine, the
stream core, the tool-call tracker, structured output and the SSE encoder;
none generates anything itself.  ``afm_http`` serves them; an application
embedding the engine can use the same translations::

    from afm_core.api import anthropic
    request = anthropic.to_chat_request(body)        # raises RequestError
    async with engine.stream(request) as stream:
        writer = anthropic.MessageStream(model="afm", input_tokens=stream.prompt_tokens)
        sse = writer.encode(writer.start())
        async for event in stream:
            sse += writer.encode(writer.feed(event))  # Anthropic events as SSE bytes
        message = writer.message()                    # the non-streaming Message

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard
library.  Never mlx, trio, the engine or HTTP code (import-linter checks it).
"""
