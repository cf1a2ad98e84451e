"""The conversion package's import point for its one error type, defined in ``qkmap_hf.errors`` (source
loading raises it too)."""

from __future__ import annotations

from ..errors import ConversionError

__all__ = ["ConversionError"]
