"""``custom_dataset`` functions of the bundled lm-eval tasks (referenced from the YAML files by module path).

lm-eval calls them with the task's metadata merged with ``--metadata`` and the model arguments, so every loader
takes ``**kwargs`` and reads only its own keys. Data comes from ``qkmap_hf/tasks/data`` (package-relative).
"""

from __future__ import annotations

import json
from typing import Any

from . import data_file
from .needle import make_needle_examples

DEFAULT_NEEDLE_WORDS = 512
DEFAULT_NEEDLE_EXAMPLES = 100
FEWSHOT_ITEMS = 40  # next-line items kept apart as the few-shot pool


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in data_file(name).read_text(encoding="utf-8").splitlines() if line.strip()]


def _dataset_dict(**splits: list[dict]):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def load_passages(**_: Any):
    """Perplexity task: passages of *The Tempest*."""
    return _dataset_dict(test=_jsonl("shakespeare_passages.jsonl"))


def load_next_line(**_: Any):
    """Multiple choice: the next line of a speech; the first items form the few-shot (train) split."""
    items = _jsonl("next_line.jsonl")
    return _dataset_dict(train=items[:FEWSHOT_ITEMS], test=items[FEWSHOT_ITEMS:])


def _positive_int(kwargs: dict, key: str, default: int) -> int:
    value = kwargs.get(key, default)
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if number <= 0 or str(number) != str(value).strip():
        raise ValueError(f"--metadata {key}={value!r} is invalid; it must be a positive integer.")
    return number


def load_needle(**kwargs: Any):
    """Long-context retrieval: a fixed variant's ``variant_words`` (its dataset_kwargs), else ``needle_words``.

    ``needle_words`` comes from ``--metadata needle_words=N`` (default 512) and only affects ``qkmap_needle``.
    """
    if "variant_words" in kwargs:
        words = _positive_int(kwargs, "variant_words", DEFAULT_NEEDLE_WORDS)
    else:
        words = _positive_int(kwargs, "needle_words", DEFAULT_NEEDLE_WORDS)
    count = _positive_int(kwargs, "needle_examples", DEFAULT_NEEDLE_EXAMPLES)
    seed = int(kwargs.get("needle_seed", 0))
    return _dataset_dict(test=[example.to_doc() for example in make_needle_examples(words, count, seed=seed)])
