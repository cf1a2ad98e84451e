"""The one error type of the conversion package."""

from __future__ import annotations


class ConversionError(ValueError):
    """A source that cannot be converted; the message names the file or field and what to do."""


__all__ = ["ConversionError"]
