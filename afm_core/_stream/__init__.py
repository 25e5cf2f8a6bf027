"""The sans-IO stream core: per-token work that turns model output into wire events.

Owns: the event records (:mod:`.events`),
the incremental detokenizer, the reasoning splitter, the tool-call fragment
tracker and one module per tool-call wire format (:mod:`.toolcalls`), stop
strings, the structured-output sanitizer, the per-stream pipeline that chains
them, the SSE frame encoder and the client-side chunk accumulator.

Everything here is pure and synchronous: ``feed(...) -> events`` and
``flush()``.  The hot stages have a Cython build (``ext/stream/X_c.pyx`` →
``afm_core._stream.X_c``, typed by the stub ``X_c.pyi``) and a typed pure twin
(``X_py.py``); the dispatcher ``X.py`` picks one (:mod:`.twins`).

May import: the standard library and :mod:`afm_core._errors`.  Never mlx,
mlx-lm, trio, HTTP code, or ``afm_core._engine`` / ``_models`` / ``_mlx``
(the import-linter contract in ``pyproject.toml`` checks it).
"""
