"""Tool-call wire formats: one module per format, and a registry.

:mod:`.base` holds what every format shares (the fragment model, call ids,
partial-JSON helpers); each format module (:mod:`.hermes`, :mod:`.llama3`,
:mod:`.mistral`, :mod:`.qwen3_coder`) turns its model's text into the
tracker's fragments; :mod:`.registry` maps a format name, or a chat
template, to the format.  Adding a format: ``docs/architecture.md``.

May import: :mod:`afm_core._stream` modules and :mod:`afm_core._errors`.
"""
