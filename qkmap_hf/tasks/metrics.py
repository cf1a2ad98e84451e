"""Metric helpers of the bundled lm-eval tasks."""

from __future__ import annotations

import re


def perplexity_results(doc: dict, results: list) -> dict:
    """Rolling log-likelihood to word/byte perplexity and bits per byte (lm-eval's wikitext convention)."""
    (loglikelihood,) = results
    text = doc["text"]
    words = len(re.split(r"\s+", text.strip()))
    num_bytes = len(text.encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, num_bytes),
        "bits_per_byte": (loglikelihood, num_bytes),
    }
