"""The refusal of a model that cannot be read or converted, shared by source loading and conversion.

It lives below both so that ``qkmap_hf.loading`` (which conversion imports) can raise it without importing the
conversion package; ``qkmap_hf.conversion.ConversionError`` is this class.
"""

from __future__ import annotations


class ConversionError(ValueError):
    """A source that cannot be read or converted; the message names the file or field and what to do."""


__all__ = ["ConversionError"]
