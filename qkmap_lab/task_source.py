"""The lab's synthetic tasks as a plugin task source (entry point ``qkmap_hf.task_sources``: ``synthetic``).

``qkmap compare --task mqar:...`` and ``qkmap analyze --task ...`` reach these tasks through it, so the plugin
runs them without importing the lab."""

from __future__ import annotations

from typing import Any

from .synthetic import TASKS, answer_accuracy, answer_argmax, parse_task, task_datasets, task_spec
from .task_probes import PROBED_TASKS, task_probes


class SyntheticTaskSource:
    """MQAR, salience and copy (``qkmap_lab.synthetic``); the probes (``qkmap_lab.task_probes``) for the first two."""

    names = tuple(TASKS)
    probed_names = PROBED_TASKS

    @staticmethod
    def parse(spec: str) -> Any:
        return parse_task(spec)

    @staticmethod
    def spec(task: Any) -> str:
        return task_spec(task)

    @staticmethod
    def datasets(task: Any, length: int, train_examples: int, heldout_blocks: int) -> tuple:
        return task_datasets(task, length, train_examples, heldout_blocks)

    @staticmethod
    def compute_metrics(eval_prediction: Any) -> dict[str, Any]:
        return answer_accuracy(eval_prediction)

    @staticmethod
    def preprocess_logits_for_metrics(logits: Any, labels: Any) -> Any:
        return answer_argmax(logits, labels)

    @staticmethod
    def probe(model: Any, task: Any, length: int, examples: int, seed: int, key_scales: tuple[float, ...]) -> dict:
        return task_probes(model, task, length, examples, seed, key_scales)


SOURCE = SyntheticTaskSource()
