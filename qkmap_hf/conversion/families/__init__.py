"""One file per source family; importing this package registers every adapter."""

from __future__ import annotations

from . import llama, mistral, qwen2, qwen3

__all__ = ["llama", "mistral", "qwen2", "qwen3"]
